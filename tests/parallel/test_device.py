"""select_device: the (device, backend) pairing and its errors, on whatever this machine has."""
import importlib.util

import pytest
import torch

from megatron_omni.parallel import DeviceSpec, select_device

HAS_CUDA = torch.cuda.is_available()
HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


def test_cpu_pairs_with_gloo():
    spec = select_device("cpu")
    assert spec == DeviceSpec("cpu", "gloo")
    assert spec.torch_device(3) == torch.device("cpu")


def test_accelerator_device_is_indexed_by_local_rank():
    # ("npu" only becomes a torch device type once torch_npu is imported.)
    assert DeviceSpec("cuda", "nccl").torch_device(3) == torch.device("cuda", 3)


@pytest.mark.skipif(HAS_CUDA or HAS_TORCH_NPU, reason="auto picks the accelerator here")
def test_auto_falls_back_to_cpu_without_accelerator():
    assert select_device() == DeviceSpec("cpu", "gloo")


@pytest.mark.skipif(HAS_CUDA, reason="CUDA is available here")
def test_unavailable_cuda_is_an_error_naming_what_is_available():
    with pytest.raises(ValueError, match=r"device 'cuda' is not available here; available: \[.*'cpu'\]"):
        select_device("cuda")


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_npu_without_torch_npu_is_an_error():
    with pytest.raises(ValueError, match=r"device 'npu' is not available here"):
        select_device("npu")


def test_unknown_device_lists_the_allowed_values():
    with pytest.raises(ValueError, match=r"device 'tpu' is not one of \['auto', 'cuda', 'npu', 'cpu'\]"):
        select_device("tpu")


@pytest.mark.gpu
def test_auto_prefers_cuda_with_nccl():
    assert select_device() == DeviceSpec("cuda", "nccl")
    assert select_device("cuda") == DeviceSpec("cuda", "nccl")
