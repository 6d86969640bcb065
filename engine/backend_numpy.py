"""CPU backend: the numpy reference model behind the common generate() interface."""

from __future__ import annotations

from collections.abc import Iterator

from engine.config import ModelConfig
from engine.qweights import dequantized, has_quantized, quantize_weights
from engine.reference import ReferenceModel
from engine.sampling import SamplingParams, sample
from engine.weights import ModelWeights

# the float32 KV cache of a long context costs a lot of host memory; cap it unless asked
DEFAULT_MAX_CONTEXT = 8192


class NumpyBackend:
    name = "numpy"

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, max_context: int | None = None,
                 quantize: str | None = None):
        """quantize (q8_0 | q4_0): quantize every matrix of dense weights at load, then compute with the
        dequantized values, as the CUDA backend multiplies by them. Quantized weights (a GGUF's) are
        dequantized to float32 here; pass them through engine.qweights.dequantized first to round to bf16."""
        if quantize is not None:
            weights = dequantized(quantize_weights(weights, quantize), round_bf16=False)
        elif has_quantized(weights):
            weights = dequantized(weights, round_bf16=False)
        self.cfg = cfg
        self.max_context = max_context or min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT)
        self.model = ReferenceModel(cfg, weights, self.max_context)

    def generate(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int) -> Iterator[int]:
        seed = params.seed or 0
        self.model.reset()
        logits = self.model.prefill(prompt_ids)
        for step in range(max_new_tokens):
            token = sample(logits, params, step, seed)
            yield token
            if step + 1 < max_new_tokens:
                logits = self.model.decode(token)
