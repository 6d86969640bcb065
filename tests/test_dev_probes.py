"""The lab's kernel copies build beside the kernels they copy: dev/gemv_tail_probe.cu and dev/gemv_tickets.cu are
kernels/gemv.cu's streaming loop and epilogues with block times added, or with the last passes handed out from a
counter, and dev/attn_oproj.cu includes attention.cu; so a change there that they no longer compile with shows
here, not on a device."""

from pathlib import Path

import pytest

from kernels.compiler import KernelCompileError, compile_kernel, declared_defines

DEV = Path(__file__).resolve().parent.parent / "dev"
LAB = {"gemv_tail_probe.cu": "probe", "gemv_tickets.cu": "tickets"}


@pytest.mark.parametrize("source", sorted(LAB))
@pytest.mark.parametrize("defines", declared_defines("gemv"), ids=lambda d: " ".join(f"{k}={v}" for k, v in d.items()))
def test_the_lab_gemvs_build_for_every_declared_gemv(source, defines):
    rope = defines["EPILOGUE"] == "EPI_ROPE"
    try:
        stats = compile_kernel(DEV / source, defines, arch="sm_90").stats
    except KernelCompileError as e:
        # the lab scripts leave a launch as it was where the copy's extra registers make it spill (and say so);
        # the rope builds hold the most registers, and only they may
        assert rope and "spill" in e.log, e.log[-2000:]
        return
    assert set(stats) == {("gemv_rope_" if rope else "gemv_") + LAB[source]}


@pytest.mark.parametrize("sum_last", ["0", "1"])
@pytest.mark.parametrize("defines", [d for d in declared_defines("attention") if d["ONE_SPLIT_HEADS"] == "1"],
                         ids=lambda d: " ".join(f"{k}={v}" for k, v in d.items()))
def test_the_folded_o_proj_builds_beside_attention(defines, sum_last):
    stats = compile_kernel(DEV / "attn_oproj.cu", {**defines, "SUM_LAST": sum_last}, arch="sm_90").stats
    assert set(stats) == {"attn_decode", "attn_oproj"}
