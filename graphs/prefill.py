"""Batched prefill: the prompt runs through the model a chunk at a time and fills the KV cache.

Per chunk of T tokens and per layer: RMSNorm -> fused QKV GEMM -> bias, q/k norm, RoPE and the
K/V append -> causal flash attention over the cache -> output GEMM (+= residual) -> RMSNorm ->
fused gate/up GEMM -> SiLU gate -> down GEMM (+= residual). The residual stream is fp32, the GEMM
inputs bf16, the GEMMs cuBLAS on tensor cores with fp32 accumulation. A matrix in a block format is
dequantized whole into a bf16 scratch (the size of the largest matrix) before its GEMM, on a side
stream into a second scratch while the GEMM before it runs (graphs/dequant_gemm.py).

The decode step then continues from the cache: `ready` prefills all but the last prompt token
and points the device state at that one, so the captured step runs it and samples its successor.
"""

from __future__ import annotations

import weakref

import numpy as np

from engine.config import ModelConfig
from engine.errors import GDecodeError, check_tokens
from graphs.buffers import DecodeBuffers, DeviceWeights
from graphs.dequant_gemm import Ahead, DequantGemm
from graphs.linear import linear
from graphs.quant_weights import is_blocks
from kernels import gemv_ops
from kernels import prefill_ops as pops
from kernels.tuning import Tuning


class _Layer:
    def __init__(self, norm1, qkv, rope, attn, wo, norm2, gate_up, silu, down):
        self.norm1, self.qkv, self.rope, self.attn, self.wo = norm1, qkv, rope, attn, wo
        self.norm2, self.gate_up, self.silu, self.down = norm2, gate_up, silu, down


class Prefill:
    """Fills `bufs`' KV cache for runs of prompt tokens, `tuning.prefill.chunk` positions per pass, on
    `stream`.

    Scratch for one chunk is allocated here, once; `run` allocates nothing.
    """

    def __init__(self, cfg: ModelConfig, weights: DeviceWeights, bufs: DecodeBuffers, stream,
                 tuning: Tuning = Tuning()):
        import cupy as cp

        pt = tuning.prefill
        h, hd, nh, kv_heads = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        inter, group = cfg.intermediate_size, cfg.num_heads // cfg.num_kv_heads
        if hd % 16 or hd > 128 or h % 8 or inter % 4 or group > pops.attn_max_group(pt.attn_warps):
            raise GDecodeError(f"batched prefill needs head_dim a multiple of 16 up to 128, hidden size a multiple "
                               f"of 8, intermediate size a multiple of 4 and at most "
                               f"{pops.attn_max_group(pt.attn_warps)} query heads per kv head (got {hd}, {h}, "
                               f"{inter}, {group})")
        chunk = pt.chunk
        self.cfg, self.weights, self.bufs, self.stream, self.chunk = cfg, weights, bufs, stream, chunk
        self.pad_rows = pt.pad_rows
        n_qkv = cfg.q_size + 2 * cfg.kv_size
        with stream:
            # rows: [chunk, width]; x is the fp32 residual, the rest GEMM inputs (bf16) or outputs (fp32)
            self.x = cp.zeros((chunk, h), cp.float32)
            self.xn = cp.zeros((chunk, h), cp.uint16)
            self.qkv = cp.zeros((chunk, n_qkv), cp.float32)
            self.q = cp.zeros((chunk, cfg.q_size), cp.uint16)
            self.attn = cp.zeros((chunk, cfg.q_size), cp.uint16)
            self.gu = cp.zeros((chunk, 2 * inter), cp.float32)
            self.act = cp.zeros((chunk, inter), cp.uint16)
            self.logits = cp.zeros(cfg.vocab_size, cp.float32)
        stream.synchronize()
        eps, ctx, rw = cfg.rms_norm_eps, bufs.max_context, pt.row_warps
        if gemv_ops.is_quant(weights.embed):
            self.embed = pops.ChunkLaunch(gemv_ops.embed_rows_quant(weights.embed, bufs.prompt, self.x, chunk=chunk))
        else:
            self.embed = pops.embed_rows(weights.embed, bufs.prompt, self.x, chunk=chunk, hidden=h,
                                         vocab=cfg.vocab_size)
        self.ahead = Ahead(stream, pt.dequant_ahead)

        def gemm(w, x, y, n, k, accumulate=False):
            if not is_blocks(w):
                return pops.Gemm(w, x, y, n, k, accumulate)
            return DequantGemm(w, self.ahead, x, y, n, k, accumulate)

        self.layers = []
        for i, lw in enumerate(weights.layers):
            k_cache, v_cache = bufs.layer_cache(i)
            self.layers.append(_Layer(
                pops.rms_rows(self.x, lw.attn_norm, self.xn, chunk=chunk, hidden=h, eps=eps, warps=rw),
                gemm(lw.wqkv, self.xn, self.qkv, n_qkv, h),
                pops.rope_rows(self.qkv, lw.bqkv, lw.q_norm, lw.k_norm, bufs.cos, bufs.sin, self.q, k_cache, v_cache,
                               chunk=chunk, nh=nh, kv_heads=kv_heads, hd=hd, max_ctx=ctx, eps=eps, warps=rw),
                pops.prefill_attn(self.q, k_cache, v_cache, self.attn, chunk=chunk, nh=nh, kv_heads=kv_heads, hd=hd,
                                  max_ctx=ctx, warps=pt.attn_warps),
                gemm(lw.wo, self.attn, self.x, h, cfg.q_size, accumulate=True),
                pops.rms_rows(self.x, lw.mlp_norm, self.xn, chunk=chunk, hidden=h, eps=eps, warps=rw),
                gemm(lw.w_gate_up, self.xn, self.gu, 2 * inter, h),
                pops.silu_rows(self.gu, self.act, chunk=chunk, inter=inter),
                gemm(lw.w_down, self.act, self.x, h, inter, accumulate=True),
            ))
        self.ahead.allocate()
        self._handle = pops.cublas_handle(stream)

    def run(self, ids, start: int = 0, logits: bool = False):
        """Write the K/V of tokens `ids` at positions start..start+len(ids)-1 into the cache.

        With logits=True the last layer runs in full and the fp32 logits of the last token are
        left in `self.logits` (returned); otherwise the last layer stops after its K/V append.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = ids.size
        check_tokens(ids, self.cfg.vocab_size, self.bufs.max_context, start)
        if n == 0:
            if logits:
                raise GDecodeError("no tokens to compute logits for")
            return None
        s = self.stream
        with s:
            self._handle = pops.cublas_handle(s)
            self.bufs.prompt[start : start + n].set(ids.astype(np.int32), stream=s)
            for c0 in range(0, n, self.chunk):
                t = min(self.chunk, n - c0)
                self._chunk(start + c0, t, full=logits and c0 + t == n)
            self.ahead.join()
            if not logits:
                return None
            row = self.x[t - 1]
            for launch in linear(self.weights.lm_head, row, self.logits, self.cfg.vocab_size, self.cfg.hidden_size,
                                 gamma=self.weights.final_norm, eps=self.cfg.rms_norm_eps):
                launch(s)
        return self.logits

    def _chunk(self, pos0: int, t: int, full: bool):
        s, h = self.stream, self._handle
        g = pops.gemm_rows(t, self.chunk) if self.pad_rows else t  # the GEMMs' rows; the rest see t
        self.embed(s, pos0, t)
        last = len(self.layers) - 1
        for i, ly in enumerate(self.layers):
            ly.norm1(s, pos0, t)
            ly.qkv(h, g)
            ly.rope(s, pos0, t)
            if i == last and not full:
                break  # the last layer's output only feeds the logits
            ly.attn(s, pos0, t)
            ly.wo(h, g)
            ly.norm2(s, pos0, t)
            ly.gate_up(h, g)
            ly.silu(s, pos0, t)
            ly.down(h, g)

    def ready(self, ids, start: int = 0) -> None:
        """After `bufs.write_state(ids, ...)`: prefill ids[start:-1] (the cache already holds the K/V of
        ids[:start]) and set the state to token ids[-1] at position n - 1, so the next decode step
        runs the last prompt token and samples its successor."""
        n = len(ids)
        check_tokens(ids, self.cfg.vocab_size, self.bufs.max_context)
        if not 0 <= start < n:
            raise GDecodeError(f"prefill start {start} is outside a prompt of {n} tokens")
        if n - 1 > start:
            self.run(ids[start:-1], start=start)
        self.bufs.seek(self.stream, n - 1)


_PREFILLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prefill_for(backend) -> Prefill:
    """The backend's own Prefill (its `prefill` attribute), else one made for it once."""
    pf = getattr(backend, "prefill", None)
    if isinstance(pf, Prefill):
        return pf
    if backend not in _PREFILLS:
        _PREFILLS[backend] = Prefill(backend.cfg, backend.weights, backend.bufs, backend.stream, backend.tuning)
    return _PREFILLS[backend]


def prefill_then_decode_ready(backend, ids, params=None, seed: int = 0) -> Prefill:
    """Start a request on a CudaBackend with its prompt prefilled in batch: the next `backend.step()`
    runs the last prompt token at position len(ids) - 1 and samples the first new token."""
    backend.start(ids, params, seed)
    pf = prefill_for(backend)
    pf.ready([int(t) for t in ids])
    return pf
