import pytest

from megatron_omni.parallel.state import destroy_parallel, init_parallel


@pytest.fixture(scope="module")
def single_rank():
    """megatron parallel state for this test process alone (world of one, TP=CP=PP=1, gloo)."""
    state = init_parallel(seed=0, device="cpu")
    yield state
    destroy_parallel()
