import pytest

from megatron_omni.parallel.state import destroy_parallel, init_parallel


@pytest.fixture(scope="package")
def single_rank():
    """megatron parallel state for one process (TP=CP=PP=1) on this test process."""
    state = init_parallel(seed=0, device="cpu")
    yield state
    destroy_parallel()
