"""Capture a sequence of launches on a stream into a CUDA graph; replay it; retarget its kernel nodes."""

from __future__ import annotations

from cuda.bindings import driver

from kernels.cuda import CudaError, check, init, stream_handle
from kernels.launch import Launch

CAPTURE_MODES = {
    "thread_local": driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
    "relaxed": driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED,
    "global": driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL,
}
_ACTIVE = driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
_KERNEL = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL


class GraphCaptureError(CudaError):
    """Capture failed: the stream has left capture mode and nothing was kept."""


class Graph:
    """An instantiated CUDA graph plus the Launch each of its captured kernel nodes came from."""

    def __init__(self, graph, exec_, records: list):
        self._graph, self._exec = graph, exec_
        self._records = records  # [(node, launch, launch.version sent to the node)]

    def replay(self, stream=None):
        """One cuGraphLaunch on `stream` (cupy Stream, handle or None for CuPy's current stream)."""
        h = stream if type(stream) is int else stream_handle(stream)
        (err,) = driver.cuGraphLaunch(self._exec, h)
        if err:
            check((err,), "cuGraphLaunch")

    def kernel_nodes(self) -> list:
        """Every kernel node of the graph (cuGraphGetNodes, filtered by type)."""
        _, count = check(driver.cuGraphGetNodes(self._graph, 0), "cuGraphGetNodes")
        nodes, count = check(driver.cuGraphGetNodes(self._graph, count), "cuGraphGetNodes")
        nodes = list(nodes)[:count]
        kinds = [check(driver.cuGraphNodeGetType(n), "cuGraphNodeGetType") for n in nodes]
        return [n for n, k in zip(nodes, kinds, strict=True) if k == _KERNEL]

    def launch_of(self, node):
        """The Launch that produced `node` during capture, or None."""
        for n, launch, _ in self._records:
            if int(n) == int(node):
                return launch
        return None

    def nodes_of(self, launch) -> list:
        return [n for n, rec, _ in self._records if rec is launch]

    @property
    def launches(self) -> list:
        """Captured launches in capture order (a launch made twice appears twice)."""
        return [launch for _, launch, _ in self._records]

    def set_node_params(self, node, launch):
        """Point one kernel node of the executable graph at `launch`'s current parameters."""
        params = launch.node_params()
        check(driver.cuGraphExecKernelNodeSetParams(self._exec, node, params), "cuGraphExecKernelNodeSetParams")
        for i, (n, *_) in enumerate(self._records):
            if int(n) == int(node):
                self._records[i] = (n, launch, launch.version)

    def update(self, launch=None) -> int:
        """Re-send the parameters of `launch` (default: of every launch changed since capture).

        Returns how many nodes were updated.
        """
        if launch is not None:
            stale = [(n, rec) for n, rec, _ in self._records if rec is launch]
        else:
            stale = [(n, rec) for n, rec, v in self._records if rec.version != v]
        for n, rec in stale:
            self.set_node_params(n, rec)
        return len(stale)

    def destroy(self):
        if self._exec is not None:
            check(driver.cuGraphExecDestroy(self._exec), "cuGraphExecDestroy")
            self._exec = None
        if self._graph is not None:
            check(driver.cuGraphDestroy(self._graph), "cuGraphDestroy")
            self._graph = None
        self._records = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()


def _last_node(h: int):
    """The node the capture of stream h just added (its single dependency), or None."""
    info = check(driver.cuStreamGetCaptureInfo(h), "cuStreamGetCaptureInfo")
    status, deps, count = info[0], info[3], info[-1]  # (status, id, graph, deps[, edge data], count)
    return deps[0] if status == _ACTIVE and count == 1 else None


def _end_and_discard(h: int):
    try:
        err, graph = driver.cuStreamEndCapture(h)
        if graph is not None and int(graph):
            driver.cuGraphDestroy(graph)
    except Exception:
        pass


def capture(stream, work, mode: str = "thread_local") -> Graph:
    """Capture `work` on `stream` and return the instantiated graph.

    work: callables run in order as item(stream_handle); each Launch among them is recorded with
    the kernel node it made, so the graph can retarget that node later (Graph.update).
    On any failure the capture is ended, the partial graph discarded, the stream left usable,
    and GraphCaptureError raised.
    """
    init()
    h = stream_handle(stream)
    check(driver.cuStreamBeginCapture(h, CAPTURE_MODES[mode]), "cuStreamBeginCapture")
    records: list = []
    try:
        for item in work:
            item(h)
            if isinstance(item, Launch):
                node = _last_node(h)
                if node is not None:
                    records.append((node, item, item.version))
    except Exception as e:
        _end_and_discard(h)
        raise GraphCaptureError("stream capture", None, f"{type(e).__name__}: {e}") from e
    except BaseException:
        _end_and_discard(h)
        raise
    err, graph = driver.cuStreamEndCapture(h)
    if err:
        if graph is not None and int(graph):
            driver.cuGraphDestroy(graph)
        raise GraphCaptureError("cuStreamEndCapture", err, "an operation during capture was not capturable")
    try:
        exec_ = check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    except CudaError as e:
        driver.cuGraphDestroy(graph)
        raise GraphCaptureError("cuGraphInstantiate", e.code, str(e)) from e
    return Graph(graph, exec_, records)
