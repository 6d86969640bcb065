"""The lab's probes build beside the kernels they copy: dev/gemv_tail_probe.cu is kernels/gemv.cu's streaming loop
and epilogues with block times added, so a change there that it no longer compiles with shows here, not on a
device."""

from pathlib import Path

import pytest

from kernels.compiler import KernelCompileError, compile_kernel, declared_defines

TAIL_PROBE = Path(__file__).resolve().parent.parent / "dev" / "gemv_tail_probe.cu"


@pytest.mark.parametrize("defines", declared_defines("gemv"), ids=lambda d: " ".join(f"{k}={v}" for k, v in d.items()))
def test_the_tail_probe_builds_for_every_declared_gemv(defines):
    rope = defines["EPILOGUE"] == "EPI_ROPE"
    try:
        stats = compile_kernel(TAIL_PROBE, defines, arch="sm_90").stats
    except KernelCompileError as e:
        # the probe leaves a launch unprobed where its stores make the build spill (the script says so); the
        # rope builds hold the most registers, and only they may
        assert rope and "spill" in e.log, e.log[-2000:]
        return
    assert set(stats) == {"gemv_rope_probe" if rope else "gemv_probe"}
