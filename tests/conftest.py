"""Shared fixtures. Tests marked ``gpu`` skip themselves where torch sees no CUDA device (see pytest.ini)."""
import pytest
import torch

from megatron_omni.parallel.state import destroy_parallel, init_parallel


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_gpu)


@pytest.fixture(scope="module")
def single_rank():
    """megatron parallel state for this test process alone (world of one, TP=CP=PP=1, gloo)."""
    state = init_parallel(seed=0, device="cpu")
    yield state
    destroy_parallel()
