"""Where ptxas puts loads around the PDL wait (kernels/sass.py): no load of what the step writes may run
ahead of `griddepcontrol.wait`, in any declared build, with the next kernel let in after the wait or, for the
launches that may do so (Tuning.trigger_first), before it. A non-coherent load (`ld.global.nc`) is one that
ptxas moves across the wait; only the weight stream may use it there. Also from the machine code: the sampler's
hand-out of its merged records uses strong stores."""

from __future__ import annotations

import pytest

from kernels import compiler, sass
from kernels.compiler import compile_kernel, declared_defines

ARCH = "sm_90"
# the sources whose kernels wait on the previous one, and those whose launches may let the next one in first
WAITING = [p for p in compiler.source_files() if p.suffix == ".cu" and
           (p.stem in ("attention", "dequant", "embed", "rope", "sample") or p.stem.startswith("gemv"))]
TRIGGERING = {p.stem for p in WAITING if p.stem == "attention" or p.stem.startswith("gemv")}

# x read with __ldg (LOAD) after the wait: ptxas hoists one of those loads above it when the next kernel's
# launch comes first (FIRST), not when it sits between the wait and the loads
DOT = """
extern "C" __global__ void dot8(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y) {
    const float4* x4 = reinterpret_cast<const float4*>(x) + threadIdx.x;
    const float4* w4 = reinterpret_cast<const float4*>(w) + blockIdx.x * 1024 + threadIdx.x;
#if FIRST
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    asm volatile("griddepcontrol.wait;" ::: "memory");
#if !FIRST
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float4 a = __ldg(w4 + 128 * i), v = LOAD(x4 + 128 * i);
        acc += a.x * v.x + a.y * v.y + a.z * v.z + a.w * v.w;
    }
    y[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
"""


@pytest.fixture(scope="module")
def disassembler():
    try:
        return sass.nvdisasm()
    except sass.NoDisassembler as e:
        pytest.fail(str(e))


def _builds():
    for src in WAITING:
        for i, defines in enumerate(declared_defines(src)):
            for first in (0, 1) if src.stem in TRIGGERING else (0,):
                yield pytest.param(src, defines, first, id=f"{src.name}-{i}" + ("-first" if first else ""))


@pytest.mark.parametrize("source,defines,first", list(_builds()))
def test_nothing_the_step_writes_is_read_ahead_of_the_wait(disassembler, source, defines, first):
    r = compile_kernel(source, defines={**defines, **({"PDL_TRIGGER_FIRST": 1} if first else {})}, arch=ARCH)
    listing = sass.disassemble(r.cubin)
    assert sass.waits(listing) > 0, f"{source.name}: no PDL wait in the machine code"
    assert sass.loads_ahead_of_wait(listing) == []


@pytest.mark.parametrize("first,load,hoisted", [(1, "__ldg", True), (1, "__ldca", False), (0, "__ldg", False)])
def test_the_check_sees_a_load_that_ptxas_hoisted(disassembler, tmp_path, first, load, hoisted):
    src = tmp_path / "dot8.cu"
    src.write_text(DOT)
    listing = sass.disassemble(compile_kernel(src, defines={"FIRST": first, "LOAD": load}, arch=ARCH).cubin)
    early = sass.loads_ahead_of_wait(listing)
    assert sass.waits(listing) == 1
    assert bool(early) == hoisted, early
    assert all(e.function == "dot8" and ".CONSTANT" in e.instruction for e in early)


def test_the_listing_is_read_by_function_and_block():
    listing = """
        .text.k:
        /*0000*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*0010*/                   LDG.E.NA.128.CONSTANT R8, desc[UR4][R6.64] ;
        /*0020*/                   LDG.E.128 R12, desc[UR4][R2.64] ;
        /*0030*/                   ACQBULK ;
.L_x_0:
        /*0040*/                   LDG.E.CONSTANT R2, desc[UR4][R2.64] ;
        /*0050*/              @!P0 BRA `(.L_x_1) ;
        /*0060*/                   ACQBULK ;
        .text.j:
        /*0000*/                   ACQBULK ;
"""
    assert sass.waits(listing) == 3
    assert set(sass.functions(listing)) == {"k", "j"}
    # the coherent and the weight-stream loads pass; past a branch is another block
    assert sass.loads_ahead_of_wait(listing) == [sass.EarlyLoad("k", "LDG.E.128.CONSTANT R4, desc[UR4][R2.64]")]
    assert sass.opcodes(listing) == ["LDG.E.128.CONSTANT", "LDG.E.NA.128.CONSTANT", "LDG.E.128", "ACQBULK",
                                     "LDG.E.CONSTANT", "BRA", "ACQBULK", "ACQBULK"]


@pytest.mark.parametrize("defines", declared_defines("sample.cu"))
def test_the_samplers_tagged_words_are_stored_strong(disassembler, defines):
    """Other blocks poll the overall records' tagged z words with relaxed GPU-scope loads while the merging
    block stores them: a weak store there would race with those loads. Every store site (st_tagged) must
    compile to a strong 64-bit store at GPU scope."""
    sites = (compiler.KERNELS_DIR / "sample.cu").read_text().count("st_tagged(work")
    ops = sass.opcodes(sass.disassemble(compile_kernel("sample.cu", defines=defines, arch=ARCH).cubin))
    assert sites >= 3
    assert ops.count("STG.E.64.STRONG.GPU") >= sites, sorted(set(o for o in ops if o.startswith("STG")))


@pytest.mark.parametrize("defines", compiler.declared_defines("sample.cu"), ids=lambda d: d["BLOCKS"])
def test_the_merges_second_level_runs_the_block_merges_code(disassembler, defines):
    """The merging block's second level reaches range_race<16, 8> through the same call as every block's own
    merge a few microseconds before, so it runs code already in that SM's instruction cache. An inlined copy
    there would be fetched cold."""
    listing = sass.disassemble(compile_kernel("sample.cu", defines=defines, arch=ARCH).cubin)
    calls = [line.split("`(")[1].rstrip(") ;").strip() for line in listing.splitlines()
             if "CALL" in line and "range_race" in line]
    shared = [c for c in calls if "range_raceILi16ELi8E" in c]
    assert len(shared) == 2 and len(set(shared)) == 1, calls
