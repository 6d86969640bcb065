"""Device buffers of the decode step, allocated once per model load: weights, KV cache, activations."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from engine.config import ModelConfig
from engine.errors import GDecodeError
from engine.sampling import SamplingParams
from engine.weights import ModelWeights
from kernels.numerics import rope_tables

BF16 = np.dtype(ml_dtypes.bfloat16)
# the C struct DecodeState of kernels/common.cuh, field for field (tests/test_state.py parses the struct)
STATE_DTYPE = np.dtype([
    ("token", "<i4"), ("pos", "<i4"), ("prompt_len", "<i4"), ("ring_mask", "<i4"),
    ("step", "<u8"), ("seed", "<u8"),
    ("temperature", "<f4"), ("top_k", "<i4"), ("top_p", "<f4"), ("min_p_log", "<f4"),
    ("repeat_penalty", "<f4"), ("repeat_last_n", "<i4"), ("presence_penalty", "<f4"), ("frequency_penalty", "<f4"),
    ("logprobs", "<i4"), ("flags", "<u4"),
])
assert STATE_DTYPE.itemsize == 72, "sizeof(DecodeState), asserted in kernels/common.cuh too"
STATE_REPEAT, STATE_COUNTS, STATE_NONFINITE = 1, 2, 4  # DecodeState.flags
INT32_MAX = 2**31 - 1
GUARD = 4096  # bf16 elements after each cache half, never written by a kernel
GUARD_BITS = 0x7FC1  # a bf16 NaN unlike the 0x7FC0 that kernels write for NaN
HEADROOM = 1 << 30  # device memory left free after sizing the KV cache
CUDA_HOST_ALLOC_MAPPED = 2  # cudaHostAllocMapped: pinned host memory the device can address


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) of a float32/float16/bfloat16 array, rounded to nearest even."""
    a = np.asarray(a)
    if a.dtype != BF16:
        a = a.astype(np.float32).astype(BF16)
    return np.ascontiguousarray(a).view(np.uint16)


@dataclass
class DeviceLayer:
    """One layer's weights: each matrix a bf16 array (uint16 bits), a QuantWeight or a StackedWeight."""

    attn_norm: object  # [H] f32
    wqkv: object  # [q_size + 2 kv_size, H]
    bqkv: object | None  # [q_size + 2 kv_size] f32
    wo: object  # [H, q_size]
    q_norm: object | None  # [hd] f32
    k_norm: object | None
    mlp_norm: object  # [H] f32
    w_gate_up: object  # [2 I, H]
    w_down: object  # [H, I]
    bo: object | None = None  # [H] f32, the o_proj bias


def _is_blocks(a) -> bool:
    # engine.quant's QuantMatrix / QuantStack, by shape of the object (graphs does not import engine.quant)
    return hasattr(a, "qtype") or hasattr(a, "parts")


class DeviceWeights:
    """Matrices (bf16, or ggml blocks repacked: graphs/quant_weights.py) and f32 vectors on the device;
    lm_head is embed when tied."""

    def __init__(self, embed, layers: list[DeviceLayer], final_norm, lm_head):
        self.embed, self.layers, self.final_norm, self.lm_head = embed, layers, final_norm, lm_head

    @classmethod
    def upload(cls, cfg: ModelConfig, w: ModelWeights, quantize: str | None = None) -> DeviceWeights:
        """Copy host weights to the device: block-quantized matrices in their own format (repacked),
        dense ones as bf16, or with quantize ("q8_0" / "q4_0") quantized on the device from their bf16
        values; vectors as f32."""
        import cupy as cp

        from graphs.quant_weights import quantize_on_device, upload_quant

        def mat(a):
            if _is_blocks(a):
                return upload_quant(a)
            bits = cp.asarray(to_bf16_bits(a))
            if quantize is None:
                return bits
            q = quantize_on_device(bits, quantize)
            del bits
            return q

        def vec(a):
            return None if a is None else cp.asarray(np.asarray(a, dtype=np.float32))

        embed = mat(w.embed)
        tied = w.lm_head is w.embed or cfg.tie_word_embeddings
        layers = [
            DeviceLayer(vec(lw.attn_norm), mat(lw.wqkv), vec(lw.bqkv), mat(lw.wo), vec(lw.q_norm),
                        vec(lw.k_norm), vec(lw.mlp_norm), mat(lw.w_gate_up), mat(lw.w_down),
                        vec(getattr(lw, "bo", None)))
            for lw in w.layers
        ]
        return cls(embed, layers, vec(w.final_norm), embed if tied else mat(w.lm_head))

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, quant: str = "bf16") -> DeviceWeights:
        """Random weights made on the device for cfg's shapes (benchmarks; no host copy): bf16, or the
        ggml types llama-quantize gives each tensor for a preset (graphs/quant_weights.py: PRESETS)."""
        import cupy as cp

        from graphs.quant_weights import PRESETS, StackedWeight, preset_type, random_quant
        from kernels import ops

        if quant != "bf16" and quant not in PRESETS:
            raise GDecodeError(f"unknown quantization {quant!r} (choose from bf16, {', '.join(PRESETS)})")
        counter = [seed * 1000003]
        L = cfg.num_layers

        def mat(rows, cols, tensor="", layer=0):
            counter[0] += 1
            if quant != "bf16":
                return random_quant(preset_type(quant, tensor, layer, L, cols), rows, cols, counter[0])
            a = cp.empty((rows, cols), cp.uint16)
            ops.fill_bf16(a, counter[0], cols**-0.5, 0.0)
            return a

        def stack(parts, cols, layer):
            mats = [mat(rows, cols, tensor, layer) for tensor, rows in parts]
            if quant == "bf16":
                return cp.concatenate(mats)
            runs, offsets = [], [0]
            for m in mats:
                if runs and runs[-1].fmt == m.fmt:
                    runs[-1] = type(m)(m.fmt, runs[-1].rows + m.rows, cols, cp.concatenate([runs[-1].data, m.data]))
                else:
                    runs.append(m)
                offsets.append(offsets[-1] + m.rows)
            if len(runs) == 1:
                return runs[0]
            starts = [0]
            for r in runs:
                starts.append(starts[-1] + r.rows)
            return StackedWeight(tuple(runs), tuple(starts))

        def vec(n, scale=0.1, offset=1.0):
            a = cp.empty(n, cp.float32)
            counter[0] += 1
            ops.fill_f32(a, counter[0], scale, offset)
            return a

        h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        n_qkv = cfg.q_size + 2 * cfg.kv_size
        tied = cfg.tie_word_embeddings
        embed = mat(cfg.vocab_size, h, "output" if tied else "token_embd")
        layers = [
            DeviceLayer(vec(h),
                        stack([("attn_q", cfg.q_size), ("attn_k", cfg.kv_size), ("attn_v", cfg.kv_size)], h, i),
                        vec(n_qkv, 0.1, 0.0) if cfg.attention_bias else None,
                        mat(h, cfg.q_size, "attn_output", i), vec(hd) if cfg.qk_norm else None,
                        vec(hd) if cfg.qk_norm else None, vec(h),
                        stack([("ffn_gate", inter), ("ffn_up", inter)], h, i), mat(h, inter, "ffn_down", i))
            for i in range(L)
        ]
        lm_head = embed if tied else mat(cfg.vocab_size, h, "output")
        return cls(embed, layers, vec(h), lm_head)

    def arrays(self) -> list:
        """Every device weight once (a tied lm_head is the embedding)."""
        out = [self.embed, self.final_norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for lw in self.layers:
            out += [a for a in vars(lw).values() if a is not None]
        return out

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays())

    def step_bytes(self) -> int:
        """Weight bytes one decode step reads: everything but the embedding table, of which it reads
        one row (the whole table again when it is the lm_head)."""
        total = self.nbytes() - int(self.embed.nbytes)
        if self.lm_head is self.embed:
            total += int(self.embed.nbytes)
        return total + int(self.embed.nbytes) // max(1, self.embed_rows())

    def embed_rows(self) -> int:
        e = self.embed
        return e.rows if hasattr(e, "rows") else e.shape[0]


def kv_bytes_per_position(cfg: ModelConfig) -> int:
    """KV cache (bf16 K and V) plus the RoPE cos/sin rows and the prompt slot of one position."""
    return cfg.kv_bytes_per_token(2) + cfg.head_dim * 4 + 4


def fit_context(cfg: ModelConfig, requested: int | None, free_bytes: int) -> int:
    """The context length to allocate: `requested`, or the model's own limit capped by free memory."""
    per = kv_bytes_per_position(cfg)
    fits = max(0, free_bytes - HEADROOM) // per
    if requested is not None:
        if requested < 1:
            raise GDecodeError(f"max context must be at least 1, got {requested}")
        if requested > fits:
            raise GDecodeError(
                f"a KV cache for {requested} positions needs {requested * per / 2**30:.1f} GiB, but only "
                f"{max(0, free_bytes - HEADROOM) / 2**30:.1f} GiB of device memory is free after the weights "
                f"(at most {fits} positions): lower --max-context")
        return requested
    ctx = min(cfg.max_position_embeddings, fits)
    if ctx < 2:
        raise GDecodeError(f"no room for a KV cache: {free_bytes / 2**30:.1f} GiB of device memory is free")
    return ctx


def state_record(params: SamplingParams | None, seed: int, *, token: int, pos: int, prompt_len: int,
                 ring_mask: int) -> np.ndarray:
    """The one DecodeState record the host writes: a request's sampling options (None: greedy) with
    the token at `pos` to run next."""
    p = params or SamplingParams(temperature=0.0)
    st = np.zeros(1, STATE_DTYPE)
    st["token"], st["pos"], st["prompt_len"], st["ring_mask"] = token, pos, prompt_len, ring_mask
    st["seed"] = np.uint64(seed % 2**64)
    st["temperature"] = 0.0 if p.greedy else p.temperature
    st["top_k"] = min(p.top_k, INT32_MAX)
    st["top_p"] = p.top_p
    st["min_p_log"] = p.min_p_log
    st["repeat_penalty"] = p.repeat_penalty
    st["repeat_last_n"] = min(p.repeat_last_n, INT32_MAX)
    st["presence_penalty"], st["frequency_penalty"] = p.presence_penalty, p.frequency_penalty
    st["logprobs"] = -1 if p.logprobs is None else p.logprobs
    st["flags"] = (STATE_REPEAT if p.penalizes_repeats else 0) | (STATE_COUNTS if p.penalizes_counts else 0)
    return st


def repeat_window(ids: np.ndarray, pos: int, last_n: int) -> np.ndarray:
    """The tokens the repeat penalty covers when the token at `pos` runs: the last last_n of ids[:pos + 1]
    (all of them for -1)."""
    start = 0 if last_n < 0 else max(0, pos + 1 - last_n)
    return ids[start : pos + 1] if last_n else ids[:0]


def host_mapped(cp, n_int32: int):
    """Pinned host memory the device can address: (numpy int32 view, memory, device address)."""
    from cuda.bindings import driver

    from kernels.cuda import check

    mem = cp.cuda.PinnedMemory(n_int32 * 4, flags=CUDA_HOST_ALLOC_MAPPED)
    view = np.ctypeslib.as_array((ctypes.c_int32 * n_int32).from_address(mem.ptr))
    return view, mem, int(check(driver.cuMemHostGetDevicePointer(mem.ptr, 0), "cuMemHostGetDevicePointer"))


class DecodeBuffers:
    """Every buffer the decode step reads or writes; nothing is allocated after this."""

    def __init__(self, cfg: ModelConfig, max_context: int, attn_splits: int, ring_size: int = 64):
        import cupy as cp

        if ring_size & (ring_size - 1):
            raise ValueError("ring_size must be a power of two")
        self.cfg, self.max_context, self.attn_splits = cfg, max_context, attn_splits
        L, kv_heads, hd, nh = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
        self.cache_elems = L * kv_heads * max_context * hd
        # kv: [K cache | guard | V cache | guard]; each cache [L, kv_heads, max_ctx, hd] bf16
        self.kv = cp.empty(2 * (self.cache_elems + GUARD), cp.uint16)
        self.kv[self.cache_elems : self.cache_elems + GUARD] = GUARD_BITS
        self.kv[2 * self.cache_elems + GUARD :] = GUARD_BITS
        self.k_cache = self.kv[: self.cache_elems]
        self.v_cache = self.kv[self.cache_elems + GUARD : 2 * self.cache_elems + GUARD]
        cos, sin = rope_tables(cfg.inv_freq(), max_context)
        self.cos, self.sin = cp.asarray(cos), cp.asarray(sin)
        self.state = cp.zeros(STATE_DTYPE.itemsize, cp.uint8)  # one DecodeState
        self.prompt = cp.zeros(max_context, cp.int32)
        f32 = cp.float32
        self.x = cp.zeros(cfg.hidden_size, f32)
        self.qkv = cp.zeros(cfg.q_size + 2 * cfg.kv_size, f32)
        self.attn = cp.zeros(cfg.q_size, f32)
        self.act = cp.zeros(cfg.intermediate_size, f32)
        self.logits = cp.zeros(cfg.vocab_size, f32)
        self.amax = cp.zeros(1, cp.uint64)  # packed argmax of the logits; the sampler resets it
        self.pm = cp.zeros((nh, attn_splits), f32)
        self.pl = cp.zeros((nh, attn_splits), f32)
        self.pacc = cp.zeros((nh, attn_splits, hd), f32)
        # the sampler's penalty counts and scratch (kernels/sample.cu)
        from kernels.ops import SAMPLE_LP_WORDS, sample_shape, sample_work_words, sm_count

        self.counts = cp.zeros(cfg.vocab_size, cp.int32)
        self.window = cp.zeros(cfg.vocab_size, cp.int32)
        self.sample_work = cp.zeros(sample_work_words(sample_shape(cfg.vocab_size, sm_count())[0]), cp.uint64)
        # rings: host-mapped pinned memory the sampler writes each step's next token (and its
        # log-probabilities) into
        self.ring_size = ring_size
        self.ring, self._ring_mem, self.ring_dev = host_mapped(cp, ring_size)
        self.ring[:] = -1
        lp, self._lp_mem, self.lp_ring_dev = host_mapped(cp, ring_size * SAMPLE_LP_WORDS)
        self.lp_ring = lp.reshape(ring_size, SAMPLE_LP_WORDS)
        self._request = None

    def layer_cache(self, layer: int):
        """(k, v) device addresses of one layer's [kv_heads, max_ctx, hd] cache."""
        n = self.cache_elems // self.cfg.num_layers
        return self.k_cache.data.ptr + 2 * layer * n, self.v_cache.data.ptr + 2 * layer * n

    def fill_cache_random(self, seed: int, stream) -> None:
        """Random bf16 K and V in every cache row (benchmarks at depth read real-looking values)."""
        from kernels.ops import fill_bf16

        fill_bf16(self.k_cache, seed, 1.0, stream=stream)
        fill_bf16(self.v_cache, seed + 1, 1.0, stream=stream)

    def guards_intact(self) -> bool:
        g = self.kv.get()
        n = self.cache_elems
        return bool((g[n : n + GUARD] == GUARD_BITS).all() and (g[2 * n + GUARD :] == GUARD_BITS).all())

    def write_state(self, stream, prompt_ids, params: SamplingParams | None = None, seed: int = 0, *,
                    pos: int = 0) -> None:
        """Start a request on `stream` (a cupy Stream), the only way the host writes the decode state:
        the prompt, the penalty counts as of `pos` and the state record (state_record) with the
        prompt's token at `pos` to run next (0, or n - 1 once a batched prefill holds the rest)."""
        import cupy as cp

        ids = np.asarray(prompt_ids, dtype=np.int32).reshape(-1)
        if not 0 <= pos < ids.size:
            raise ValueError(f"position {pos} is outside a prompt of {ids.size} tokens")
        p = params or SamplingParams(temperature=0.0)
        self._request = (ids, p, seed)
        st = state_record(p, seed, token=int(ids[pos]), pos=pos, prompt_len=ids.size, ring_mask=self.ring_size - 1)
        with stream:
            self.prompt[: ids.size].set(ids, stream=stream)
            if p.penalizes_counts:
                self.counts.fill(0)
            if p.penalizes_repeats:
                self.window.fill(0)
                toks, n = np.unique(repeat_window(ids, pos, p.repeat_last_n), return_counts=True)
                if toks.size:
                    self.window[cp.asarray(toks)] = cp.asarray(n.astype(np.int32))
            self.state.set(st.view(np.uint8), stream=stream)
        stream.synchronize()

    def seek(self, stream, pos: int) -> None:
        """Point the current request (the last write_state) at position `pos` of its prompt."""
        if self._request is None:
            raise RuntimeError("no request to seek in: write_state first")
        ids, params, seed = self._request
        self.write_state(stream, ids, params, seed, pos=pos)

    def read_state(self) -> dict:
        st = self.state.get().view(STATE_DTYPE)[0]
        return {name: st[name].item() for name in STATE_DTYPE.names}
