"""`gdecode generate` end to end on the CUDA backend (skipped without a GPU)."""

import pytest

from tests.test_cli import assert_stops_at_context_limit, gdecode
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("cli_gpu") / "m", "qwen2", tied=True, heads=8, kv_heads=2)


def test_generate_on_cuda_graph_equals_eager(tiny):
    args = ("generate", "hello there", "--model", tiny, "--backend", "cuda", "--max-new-tokens", "24",
            "--temperature", "0.9", "--seed", "5")
    graph, eager = gdecode(*args), gdecode(*args, "--no-graph")
    assert graph.returncode == 0, graph.stderr
    assert eager.returncode == 0, eager.stderr
    assert "[cuda]" in graph.stderr and "tok/s" in graph.stderr
    assert graph.stdout == eager.stdout and graph.stdout.strip()


def test_generate_on_cuda_stops_at_the_context_limit(tiny):
    assert_stops_at_context_limit(tiny, "cuda", "a b c", 20)


def test_prompt_longer_than_the_cuda_context(tiny):
    r = gdecode("generate", "word " * 50, "--model", tiny, "--backend", "cuda", "--max-context", "16")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and "context" in r.stderr
