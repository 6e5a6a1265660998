"""Shared fixtures. Tests marked ``gpu`` skip themselves where torch sees no CUDA device (see pytest.ini)."""
import getpass
import os
import tempfile

import pytest
import torch

from megatron_omni.parallel.state import destroy_parallel, init_parallel

# torch.compile's FX graph cache (torch 2.13) keys a graph without the vector ISA that ATEN_CPU_CAPABILITY picks
# for inductor's C++ kernels: a graph cached by a plain run (AVX-512 code) is found again under
# ATEN_CPU_CAPABILITY=default or avx2 and its code compiled without the AVX-512 defines (C++ compile error:
# 'at::vec' has not been declared).  One cache folder per capability; the ranks and engine processes the tests
# start inherit it.  A plain run keeps inductor's default folder.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY']}")


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


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module, restored after it: tiny models run many times faster so on a shared
    2-core machine.  Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
