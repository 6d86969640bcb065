import ctypes
import time
from pathlib import Path

import numpy as np
import pytest
from cuda.bindings import driver

from graphs.graph import GraphCaptureError, capture
from kernels.cuda import CudaError, check, device_attribute, init, shared_stream
from kernels.launch import Module, pack_args

CHAIN = Path(__file__).resolve().parent / "kernels" / "chain.cu"
N = 12345  # awkward size: partial last block, grid-stride loops
GRID, BLOCK = 7, 256
REPLAYS = 1000
gpu = pytest.mark.gpu


class Chain:
    """t = 1.5 x - 0.25; u = t * s[0]; y = 0.5 u + 2; out = sum(y), as four prepared launches."""

    def __init__(self, cp, module, x, s, pdl=False):
        self.cp = cp
        self.t, self.u, self.y = (cp.empty(N, cp.float32) for _ in range(3))
        self.out = cp.empty(1, cp.float32)
        axpb = module.function("axpb", "PPffi")
        self.launches = [
            axpb.prepare(GRID, BLOCK, [self.t, x, 1.5, -0.25, N]),
            module.function("scale", "PPPi").prepare(GRID, BLOCK, [self.u, self.t, s, N], pdl=pdl),
            axpb.prepare(GRID, BLOCK, [self.y, self.u, 0.5, 2.0, N], pdl=pdl),
            module.function("block_sum", "PPi").prepare(1, BLOCK, [self.out, self.y, N], pdl=pdl),
        ]

    def poison(self, stream):
        with stream:
            for b in (self.t, self.u, self.y, self.out):
                b.fill(np.nan)

    def run(self, stream):
        for launch_ in self.launches:
            launch_(stream)


@pytest.fixture(scope="module")
def cp():
    import cupy

    init()
    return cupy


@pytest.fixture(scope="module")
def stream(cp):
    return shared_stream()


@pytest.fixture(scope="module")
def module(cp):
    m = Module.load(CHAIN)
    yield m
    m.unload()


@pytest.fixture
def inputs(cp, stream):
    x, s = cp.empty(N, cp.float32), cp.empty(1, cp.float32)
    refill(cp, stream, x, s)
    return x, s


def refill(cp, stream, x, s):
    with stream:
        x[...] = cp.random.standard_normal(N, dtype=cp.float32)
        s[...] = cp.random.standard_normal(1, dtype=cp.float32)


def check_reference(cp, stream, x, s, chain, y=None):
    stream.synchronize()
    xh, sh = cp.asnumpy(x).astype(np.float64), float(cp.asnumpy(s)[0])
    y_ref = 0.5 * ((1.5 * xh - 0.25) * sh) + 2.0
    np.testing.assert_allclose(cp.asnumpy(chain.y if y is None else y), y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cp.asnumpy(chain.out)[0], y_ref.sum(), rtol=1e-4)


def count_mismatches(cp, a, b):
    return cp.count_nonzero(a.y != b.y) + cp.count_nonzero(a.out != b.out)  # NaN != NaN counts


def test_pack_args_builds_pointer_array():
    values, array = pack_args([0x1234, 7, 2.5], "Pif")
    assert [type(v) for v in values] == [ctypes.c_uint64, ctypes.c_int32, ctypes.c_float]
    assert ctypes.c_uint64.from_address(array[0]).value == 0x1234
    assert ctypes.c_int32.from_address(array[1]).value == 7
    assert ctypes.c_float.from_address(array[2]).value == 2.5
    values, _ = pack_args([(0x10, ctypes.c_void_p), ctypes.c_uint32(3)])
    assert values[0].value == 0x10 and values[1].value == 3
    with pytest.raises(ValueError):
        pack_args([1, 2], "P")
    with pytest.raises(TypeError):
        pack_args([1])


@gpu
def test_replay_matches_eager(cp, stream, module, inputs):
    x, s = inputs
    eager, graphed = Chain(cp, module, x, s), Chain(cp, module, x, s)
    with capture(stream, graphed.launches) as graph:
        assert len(graph.kernel_nodes()) == 4 and graph.launches == graphed.launches
        with stream:
            mismatches = cp.zeros((), cp.int64)
        for _ in range(REPLAYS):
            refill(cp, stream, x, s)
            eager.poison(stream)
            graphed.poison(stream)
            graph.replay(stream)
            eager.run(stream)
            with stream:
                mismatches += count_mismatches(cp, eager, graphed)
        stream.synchronize()
        assert int(mismatches) == 0
        check_reference(cp, stream, x, s, graphed)


@gpu
def test_node_update_points_at_new_buffer(cp, stream, module, inputs):
    x, s = inputs
    ref, chain = Chain(cp, module, x, s), Chain(cp, module, x, s)
    with capture(stream, chain.launches) as graph:
        nodes = graph.kernel_nodes()
        assert len(nodes) == 4 and {graph.launch_of(n) for n in nodes} == set(chain.launches)
        assert all(len(graph.nodes_of(launch_)) == 1 for launch_ in chain.launches)
        y2 = cp.empty(N, cp.float32)
        chain.launches[2].set_arg(0, y2)  # y = 0.5 u + 2 now lands in y2
        chain.launches[3].set_arg(1, y2)  # and the sum reads it from there
        assert graph.update() == 2 and graph.update() == 0
        chain.poison(stream)
        with stream:
            y2.fill(np.nan)
        graph.replay(stream)
        ref.run(stream)
        stream.synchronize()
        assert bool(cp.isnan(chain.y).all()), "the old buffer was written after the update"
        assert bool((y2 == ref.y).all()) and bool((chain.out == ref.out).all())
        check_reference(cp, stream, x, s, chain, y=y2)

        chain.launches[2].update_args([chain.y, chain.u, 0.5, 2.0, N])
        chain.launches[3].update_args([chain.out, chain.y, N])
        assert graph.update(chain.launches[2]) == 1 and graph.update() == 1
        chain.poison(stream)
        graph.replay(stream)
        stream.synchronize()
        assert bool((chain.y == ref.y).all()) and bool((chain.out == ref.out).all())


@gpu
def test_failed_capture_leaves_stream_usable(cp, stream, module, inputs):
    x, s = inputs
    ref, chain = Chain(cp, module, x, s), Chain(cp, module, x, s)

    def raises(h):
        raise ValueError("boom")

    def illegal(h):
        check(driver.cuStreamSynchronize(h), "cuStreamSynchronize")

    with pytest.raises(GraphCaptureError, match="boom"):
        capture(stream, [*chain.launches, raises])
    with pytest.raises(GraphCaptureError, match="cuStreamSynchronize"):
        capture(stream, [chain.launches[0], illegal])
    status = check(driver.cuStreamIsCapturing(stream.ptr), "cuStreamIsCapturing")
    assert status == driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    chain.poison(stream)
    chain.run(stream)
    check_reference(cp, stream, x, s, chain)
    with capture(stream, chain.launches) as graph:
        chain.poison(stream)
        graph.replay(stream)
        ref.run(stream)
        stream.synchronize()
        assert int(count_mismatches(cp, ref, chain)) == 0


@gpu
def test_programmatic_dependent_launch(cp, stream, module, inputs):
    if device_attribute("COMPUTE_CAPABILITY_MAJOR") < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    x, s = inputs
    plain, pdl = Chain(cp, module, x, s), Chain(cp, module, x, s, pdl=True)
    plain.poison(stream)
    pdl.poison(stream)
    plain.run(stream)
    pdl.run(stream)
    stream.synchronize()
    assert int(count_mismatches(cp, plain, pdl)) == 0
    with capture(stream, pdl.launches) as graph:
        for _ in range(10):
            refill(cp, stream, x, s)
            plain.poison(stream)
            pdl.poison(stream)
            graph.replay(stream)
            plain.run(stream)
            stream.synchronize()
            assert int(count_mismatches(cp, plain, pdl)) == 0


@gpu
def test_dynamic_shared_memory_opt_in_and_one_off_launch(cp, stream, module, inputs):
    x, _ = inputs
    y = cp.empty(N, cp.float32)
    axpb = module.function("axpb", "PPffi")
    axpb.launch(GRID, BLOCK, [y, x, 2.0, 1.0, N], smem=100 * 1024, stream=stream)
    stream.synchronize()
    np.testing.assert_allclose(cp.asnumpy(y), 2.0 * cp.asnumpy(x) + 1.0, rtol=1e-6, atol=1e-6)
    assert module.function("axpb") is axpb
    with pytest.raises(CudaError, match="no_such_kernel"):
        module.function("no_such_kernel")


@gpu
def test_host_cost_per_replay_and_launch(cp, stream, module, inputs, capsys):
    x, s = inputs
    chain = Chain(cp, module, x, s)
    # a counter beside the chain: each replay or eager run adds exactly 1 to every element of c
    with stream:
        c, tmp = cp.zeros(N, cp.float32), cp.empty(N, cp.float32)
    axpb = module.function("axpb", "PPffi")
    launches = chain.launches + [axpb.prepare(GRID, BLOCK, [tmp, c, 1.0, 1.0, N]),
                                 axpb.prepare(GRID, BLOCK, [c, tmp, 1.0, 0.0, N])]

    def step():
        for launch_ in launches:
            launch_(stream)

    batches, per_batch = 10, 100  # sync between batches so a full launch queue never blocks the host
    n = batches * per_batch
    with capture(stream, launches) as graph:
        assert len(graph.kernel_nodes()) == len(launches)
        chain.poison(stream)
        replay_s = eager_s = 0.0
        t_all = time.perf_counter()
        for _ in range(batches):
            t = time.perf_counter()
            for _ in range(per_batch):
                graph.replay(stream)
            replay_s += time.perf_counter() - t
            stream.synchronize()
        gpu_replay = (time.perf_counter() - t_all) / n
        assert bool((c == n).all()), "each replay runs the captured step exactly once"
        check_reference(cp, stream, x, s, chain)
        chain.poison(stream)
        for _ in range(batches):
            t = time.perf_counter()
            for _ in range(per_batch):
                step()
            eager_s += time.perf_counter() - t
            stream.synchronize()
        assert bool((c == 2 * n).all())
        check_reference(cp, stream, x, s, chain)
    with capsys.disabled():
        print(f"\n  host per graph replay ({len(launches)} kernels): {replay_s / n * 1e6:.2f} us;"
              f" host per eager launch: {eager_s / (n * len(launches)) * 1e6:.2f} us;"
              f" replay incl. GPU: {gpu_replay * 1e6:.2f} us")
