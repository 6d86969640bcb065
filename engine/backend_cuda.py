"""CUDA backend: every decode step is one replay of a captured graph; tokens stream back asynchronously."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np

from engine.config import ModelConfig
from engine.errors import GDecodeError, NonFiniteLogits, check_tokens
from engine.prefix import shared_prefix
from engine.sampling import SamplingParams, TokenLogprobs
from engine.weights import ModelWeights
from kernels.tuning import Tuning

RING = 64  # host ring slots the sampler writes into (power of two)
IN_FLIGHT = 8  # replays queued ahead of the token being read


class CudaBackend:
    """Decode on the GPU: weights, KV cache and the captured step are built once, here.

    weights None: random weights made on the device (benchmarks), bf16 or in the ggml types of the
    random_quant preset. quantize ("q8_0" / "q4_0"): dense matrices quantized on the device at load
    (block-format matrices of a GGUF stay as they are). tuning: launch shapes; its
    splits, when None, become default_splits (self.tuning holds the value in use).
    """

    name = "cuda"

    def __init__(self, cfg: ModelConfig, weights: ModelWeights | None, max_context: int | None = None,
                 tuning: Tuning = Tuning(), use_graph: bool = True, pdl: bool = True, seed: int = 0,
                 quantize: str | None = None, random_quant: str = "bf16"):
        import cupy as cp

        from graphs.buffers import DecodeBuffers, DeviceWeights, fit_context
        from graphs.decode import ATTN_MAX_SPLITS, DecodeStep, default_splits
        from graphs.prefill import Prefill
        from kernels.cuda import init, shared_stream

        if cfg.o_proj_bias:  # never drop a bias: refuse until the decode step applies it
            raise GDecodeError("this checkpoint puts a bias on o_proj (attention_bias), which the cuda backend "
                               "does not apply yet: use --backend numpy")
        init()
        self.cfg = cfg
        self.stream = stream = shared_stream()
        with stream:
            if weights is None:
                self.weights = DeviceWeights.random(cfg, seed, random_quant)
            else:
                self.weights = DeviceWeights.upload(cfg, weights, quantize)
            stream.synchronize()
            cp.get_default_memory_pool().free_all_blocks()
            free = cp.cuda.runtime.memGetInfo()[0]
            self.max_context = fit_context(cfg, max_context, free)
            if tuning.splits is None:
                tuning = replace(tuning, splits=default_splits(cfg, tuning))
            if not 1 <= tuning.splits <= ATTN_MAX_SPLITS:
                raise GDecodeError(f"attention splits must be in [1, {ATTN_MAX_SPLITS}], got {tuning.splits}")
            self.tuning, self.attn_splits = tuning, tuning.splits
            self.bufs = DecodeBuffers(cfg, self.max_context, self.attn_splits, RING)
            try:
                self.prefill = Prefill(cfg, self.weights, self.bufs, stream, tuning)
            except GDecodeError:
                self.prefill = None  # a head size the prefill kernels don't cover: replay the prompt
            stream.synchronize()
        self.step = DecodeStep(cfg, self.weights, self.bufs, stream, tuning, use_graph, pdl)
        self._events = [cp.cuda.Event(disable_timing=True) for _ in range(RING)]
        self.held: list[int] = []  # the tokens whose K/V the cache holds at positions 0..len-1
        self.reused = 0  # prompt tokens the last generate() took from the cache
        self.token_logprobs: TokenLogprobs | None = None  # the last yielded token's, when asked for
        self.warm_up()

    def warm_up(self) -> None:
        """Run requests whose prompts prefill each of the prefill GEMMs' row counts (1, 2, 4, ..., 64, 128,
        192, ... up to a full chunk), so that the first real request pays no lazy module loading or
        cuBLAS set-up for a new shape. The cache rows written are not held for reuse."""
        from kernels.prefill_ops import gemm_buckets

        if self.prefill is None:
            return
        longest = min(self.prefill.chunk, self.max_context - 2)  # a prompt of n + 1 leaves a position
        if longest < 1:
            return
        for n in [b for b in gemm_buckets(self.prefill.chunk) if b < longest] + [longest]:
            for _ in self.generate([0] * (n + 1), SamplingParams(temperature=0.0, max_new_tokens=1), 1):
                pass
        self.held, self.reused = [], 0

    def start(self, prompt_ids, params: SamplingParams | None = None, seed: int = 0, prefill: bool = False,
              keep: int = 0) -> int:
        """Load a prompt and sampling parameters into the device state (position 0); with prefill,
        prompt tokens keep..n-2 go through the batched prefill (the cache already holds 0..keep-1)
        and the state points at the last. Returns the position the next replay runs."""
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise GDecodeError("the prompt is empty")
        check_tokens(ids, self.cfg.vocab_size, self.max_context)
        p = params or SamplingParams(temperature=0.0)
        self.held = []
        self.stream.synchronize()
        self.bufs.write_state(self.stream, ids, p, seed)
        if prefill and self.prefill is not None and len(ids) > 1:
            self.prefill.ready(ids, start=keep)
            return len(ids) - 1
        return 0

    def replay(self, n: int = 1) -> None:
        """Queue n decode steps (no host copy between them)."""
        for _ in range(n):
            self.step()

    def step_logits(self) -> np.ndarray:
        """The fp32 logits of the last step, [V] (synchronises)."""
        self.stream.synchronize()
        return self.bufs.logits.get(stream=self.stream)

    def device_state(self) -> dict:
        self.stream.synchronize()
        return self.bufs.read_state()

    def _logprobs(self, slot: int) -> TokenLogprobs:
        """The log-probability record the sampler left in ring slot `slot`."""
        rec = self.bufs.lp_ring[slot]
        lps = rec.view(np.float32)
        n = int(rec[2])
        return TokenLogprobs(int(rec[0]), float(lps[1]),
                             tuple((int(rec[3 + 2 * j]), float(lps[4 + 2 * j])) for j in range(n)))

    def generate(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
                 reuse: bool = False) -> Iterator[int]:
        """Yield up to max_new_tokens sampled ids; stops early at the context limit.

        The first n-1 prompt tokens are prefilled in batch; the first replay runs the last prompt
        token at position n-1 and samples. Up to IN_FLIGHT replays are queued ahead of the token
        being read from the host ring (a token of -1 there: that step's logits were not finite, raised
        as NonFiniteLogits). With params.logprobs, token_logprobs holds each yielded token's. With
        reuse (and the batched prefill), the prompt's longest prefix that the cache already holds is
        not prefilled again.
        """
        ids = [int(t) for t in prompt_ids]
        n = len(ids)
        keep = shared_prefix(self.held, ids) if reuse and self.prefill is not None else 0
        self.reused = keep
        issued = self.start(ids, params, params.seed or 0, prefill=True, keep=keep)
        end = min(n - 1 + max_new_tokens, self.max_context)
        out: list[int] = []
        try:
            for j in range(n - 1, end):
                while issued < end and issued <= j + IN_FLIGHT:
                    self.step()
                    self._events[issued % RING].record(self.stream)
                    issued += 1
                self._events[j % RING].synchronize()
                token = int(self.bufs.ring[j % RING])
                if token < 0:
                    raise NonFiniteLogits(j - (n - 1), self.name, params=params)
                if params.logprobs is not None:
                    self.token_logprobs = self._logprobs(j % RING)
                out.append(token)
                yield token
        finally:
            self.stream.synchronize()
            # replays ran positions up to issued-1; the token at position n+i is out[i]
            self.held = (ids + out)[:issued]
