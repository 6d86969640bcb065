import pytest

from kernels.cuda import gpu_available


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU available")
    for item in gpu_items:
        item.add_marker(skip)
