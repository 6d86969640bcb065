"""A projection of the decode step as launches: one GEMV for a matrix of one format, one per part for
a StackedWeight (parts of different formats), each part's rows going to their own rows of y."""

from __future__ import annotations

from graphs.quant_weights import StackedWeight
from kernels.gemv_ops import EPI_GATE, EPI_SILU, EPI_STORE, gemv, gemv_rope
from kernels.launch import Launch
from kernels.tuning import GemvTuning

F32 = 4


def _at(a, row: int):
    """Device address of element `row` of an f32 vector (None stays None)."""
    return None if a is None else int(a.data.ptr) + F32 * row


def linear(w, x, y, n_out: int, k: int, *, gamma=None, bias=None, epi=EPI_STORE, eps: float = 0.0, amax=None,
           tuning: GemvTuning = GemvTuning(), pair: bool = False, pdl: bool = False,
           whole: bool = False, trigger_first: bool = False) -> list[Launch]:
    """y (=, +=, silu-gated) W x as kernels.gemv_ops.gemv does it, for any device matrix (whole: gemv's, for
    a matrix of one format; trigger_first: gemv's, never for the parts of a stack).

    A gate/up pair of two formats (EPI_SILU) runs as two GEMVs: up stored into y, then the gate's
    epilogue y = silu(gate) * y.
    """
    if not isinstance(w, StackedWeight):
        return [gemv(w, x, y, n_out, k, gamma=gamma, bias=bias, epi=epi, eps=eps, amax=amax, tuning=tuning,
                     pair=pair, pdl=pdl, whole=whole, trigger_first=trigger_first)]
    if amax is not None:
        raise ValueError("the argmax needs the rows in one matrix")
    # a part after the first reads x before its wait (LATE_WAIT), safe only while the part before it lets it
    # launch after its own wait: the parts never trigger first
    common = dict(gamma=gamma, eps=eps, tuning=tuning, pdl=pdl)
    if epi == EPI_SILU:
        if w.offsets != (0, n_out, 2 * n_out):
            raise ValueError(f"gate/up parts at rows {w.offsets}, expected (0, {n_out}, {2 * n_out})")
        gate, up = w.parts
        return [gemv(up, x, y, n_out, k, bias=_at(bias, n_out), epi=EPI_STORE, **common),
                gemv(gate, x, y, n_out, k, bias=bias, epi=EPI_GATE, **common)]
    # the parts write their own rows of y and read only x: each after the first overlaps the one before
    return [gemv(p, x, _at(y, r0), r1 - r0, k, bias=_at(bias, r0), epi=epi, late_wait=i > 0 and tuning.parts_overlap,
                 **common)
            for i, (p, r0, r1) in enumerate(zip(w.parts, w.offsets, w.offsets[1:], strict=False))]


def linear_rope(w, x, gamma, bias, y, state, cos, sin, k_cache, v_cache, *, nh: int, nkv: int, hd: int, k: int,
                max_ctx: int, eps: float, tuning: GemvTuning = GemvTuning(), pdl: bool = False,
                trigger_first: bool = False) -> list[Launch]:
    """The fused QKV with RoPE and the K/V append: one gemv_rope per part (parts hold whole heads)."""
    common = dict(nh=nh, nkv=nkv, hd=hd, k=k, max_ctx=max_ctx, eps=eps, tuning=tuning, pdl=pdl)
    if not isinstance(w, StackedWeight):
        return [gemv_rope(w, x, gamma, bias, y, state, cos, sin, k_cache, v_cache, trigger_first=trigger_first,
                          **common)]
    out = []
    for i, (p, r0, r1) in enumerate(zip(w.parts, w.offsets, w.offsets[1:], strict=False)):
        if r0 % hd or r1 % hd:
            raise ValueError(f"a QKV part at rows {r0}..{r1} splits a head of {hd}")
        # the parts write their own heads and read only x and the position: each after the first
        # overlaps the one before
        out.append(gemv_rope(p, x, gamma, bias, y, state, cos, sin, k_cache, v_cache, head0=r0 // hd,
                             heads=(r1 - r0) // hd, late_wait=i > 0 and tuning.parts_overlap, **common))
    return out
