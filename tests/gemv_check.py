"""The GEMV epilogues in numpy, and one check that runs a GEMV launch on poisoned outputs against them.

Shared by the bf16 GEMV tests (test_kernels_gpu.py) and the block-format ones (test_quant_gpu.py):
one reference for the one epilogue implementation that every weight format feeds.
"""

from __future__ import annotations

import numpy as np

from kernels.gemv_ops import EPI_ADD, EPI_GATE, EPI_SILU, EPI_STORE


def rms(x, g, eps):
    return x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + eps) * g


def silu(v):
    return v / (1 + np.exp(-v))


def rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "non-finite output (an element left unwritten?)"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def amax_of(x):
    """The packed argmax word the lm_head GEMV leaves for the sampler (value key, then lowest index)."""
    u = np.asarray(x, np.float32) + np.float32(0)
    u = u.view(np.uint32).astype(np.uint64)
    key = np.where(u & 0x80000000, ~u & 0xFFFFFFFF, u | 0x80000000)
    i = int(np.argmax(x))
    return np.array([(int(key[i]) << 32) | (0xFFFFFFFF - i)], np.uint64)


def epilogue_ref(full, epi, n_out: int, y0, bias):
    """What y holds after the GEMV: full = W x (float64, all rows of W), y0 = y before, bias over W's rows."""
    b = np.zeros(len(full)) if bias is None else bias.astype(np.float64)
    v = full + b
    if epi == EPI_STORE:
        return v
    if epi == EPI_ADD:
        return y0 + v
    if epi == EPI_GATE:
        return silu(v) * y0
    assert epi == EPI_SILU
    return silu(v[:n_out]) * v[n_out:]


class GemvCase:
    """Random inputs for y = epilogue(W x) with W's float values wf [rows, k] (what the kernel must
    multiply by); outputs start as NaN unless the epilogue reads them. EPI_STORE also checks the argmax
    word unless argmax is False."""

    def __init__(self, rng, wf, n_out: int, epi, norm: bool, bias: bool, eps: float = 1e-5, argmax: bool = True,
                 xq: bool = False):
        rows, k = wf.shape
        self.wf, self.n_out, self.epi, self.eps, self.argmax, self.xq = wf, n_out, epi, eps, argmax, xq
        # with the fused RMSNorm, a mean square near 2 eps: dropping eps (or scaling it) shows
        self.x = (rng.standard_normal(k) * (np.sqrt(2 * eps) if norm else 3)).astype(np.float32)
        self.g = (0.5 + rng.random(k)).astype(np.float32) if norm else None
        self.b = rng.standard_normal(rows).astype(np.float32) if bias else None
        self.y0 = rng.standard_normal(n_out).astype(np.float32)

    def xin(self, xq: bool | None = None):
        """The x the rows are multiplied by (float64): normalized with gamma; xq (default: the case's) rounds
        x times gamma to int8 per 32 as the block-format GEMVs do, and applies 1/rms after."""
        if not (self.xq if xq is None else xq):
            return rms(self.x, self.g, self.eps) if self.g is not None else self.x.astype(np.float64)
        from kernels.gemv_ops import dequantize_x, quantize_x

        xh = dequantize_x(*quantize_x(self.x * self.g if self.g is not None else self.x))
        return xh if self.g is None else xh / np.sqrt(np.mean(self.x.astype(np.float64) ** 2) + self.eps)

    def ref(self, xq: bool | None = None):
        return epilogue_ref(self.wf.astype(np.float64) @ self.xin(xq), self.epi, self.n_out, self.y0, self.b)

    def device(self, cp):
        """(x, gamma, bias, y, amax) on the device; y poisoned unless the epilogue reads it."""
        reads_y = self.epi in (EPI_ADD, EPI_GATE)
        y = cp.asarray(self.y0) if reads_y else cp.full(self.n_out, np.nan, cp.float32)
        amax = cp.zeros(1, cp.uint64) if self.epi == EPI_STORE and self.argmax else None
        x, g, b = (None if a is None else cp.asarray(a) for a in (self.x, self.g, self.b))
        return x, g, b, y, amax


def run_launches(cp, launches):
    for launch in launches if isinstance(launches, list) else [launches]:
        launch(None)
    cp.cuda.get_current_stream().synchronize()


def check(cp, case: GemvCase, make, tol: float) -> float:
    """Run make(x, gamma, bias, y, amax) -> launch(es); compare y (and the argmax word) with numpy."""
    x, g, b, y, amax = case.device(cp)
    run_launches(cp, make(x, g, b, y, amax))
    got = y.get()
    if amax is not None:
        assert amax.get()[0] == amax_of(got)[0], "argmax word"
    err = rel(got, case.ref())
    assert err < tol, f"rel err {err:.2e}"
    return err


def rope_ref(x, c, s):
    """Rotate-half RoPE of heads x [n, hd] at (cos c, sin s) [hd / 2], float64."""
    x = x.astype(np.float64)
    half = x.shape[-1] // 2
    x1, x2 = x[:, :half], x[:, half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
