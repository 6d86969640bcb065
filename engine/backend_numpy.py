"""CPU backend: the numpy reference model behind the common generate() interface."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from engine.config import ModelConfig
from engine.prefix import shared_prefix
from engine.qweights import dequantized, has_quantized, quantize_weights
from engine.reference import ReferenceModel
from engine.sampling import Sampler, SamplingParams, TokenLogprobs
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
        self.held: list[int] = []  # the tokens whose K/V the cache holds at positions 0..len-1
        self.reused = 0  # prompt tokens the last generate() took from the cache
        self.token_logprobs: TokenLogprobs | None = None  # the last yielded token's, when asked for

    def generate(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
                 reuse: bool = False) -> Iterator[int]:
        """Yield up to max_new_tokens sampled ids. With reuse, the prompt's longest prefix that the
        cache already holds (all but its last token at most) is not prefilled again. With
        params.logprobs, token_logprobs holds each yielded token's."""
        seed = params.seed or 0
        ids = [int(t) for t in prompt_ids]
        keep = shared_prefix(self.held, ids) if reuse else 0
        self.reused = keep
        self.held = ids[:keep]
        self.model.pos = keep
        with np.errstate(all="ignore"):  # NaN/Inf are reported below, by step
            logits = self.model.prefill(ids[keep:])
        self.held = ids
        sampler = Sampler(params, seed, self.cfg.vocab_size, ids)
        for step in range(max_new_tokens):
            token = sampler(logits)
            self.token_logprobs = sampler.logprobs
            yield token
            if step + 1 < max_new_tokens:
                with np.errstate(all="ignore"):
                    logits = self.model.decode(token)
                self.held.append(token)
