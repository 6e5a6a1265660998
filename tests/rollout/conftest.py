"""Rollout tests work on small tensors: one intra-op thread is fastest there, and on shared busy cores
OpenMP workers that wait on each other make these tests many times slower (measured: 6 s vs 0.1 s)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
