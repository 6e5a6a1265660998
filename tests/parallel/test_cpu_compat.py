"""The CPU layer for megatron-core 0.19.2, patch by patch.

For each patch: the real megatron call that needs it fails without it (the original torch function put
back for that one call) and gives the right numbers with it.  Everything multi-rank runs in ONE 2-rank
gloo launch (tests/parallel/compat_cases.py); each test below checks one part of it.
"""
import re

import pytest
import torch

from megatron_omni.parallel import apply_cpu_compat, cuda_factories_on_cpu
from megatron_omni.parallel.testing import run_distributed
from tests.parallel.compat_cases import compat_cases

# What a CUDA call raises without a usable GPU: on a CPU build of torch, and on a CUDA build whose GPUs
# are hidden (run_distributed's gloo ranks see none, so the multi-rank part runs on GPU machines too).
NO_CUDA = "Torch not compiled with CUDA enabled|No CUDA GPUs are available"
in_process_without_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="in this process CUDA exists, and the layer changes nothing"
)


# --- in-process: the scoped factory mode (it leaves no global state behind) ---------------------------------

@in_process_without_cuda
def test_cuda_factories_inside_the_scope_are_made_on_cpu():
    with cuda_factories_on_cpu():
        made = [
            torch.zeros([], dtype=torch.int, device="cuda"),  # schedules.py:749
            torch.tensor([1.0], device="cuda:0"),
            torch.empty(2, device=0),
            torch.ones(1, device=torch.device("cuda", 1)),
            torch.empty_like(torch.ones(2), device="cuda"),
        ]
        on_meta = torch.zeros(1, device="meta")
    assert [t.device.type for t in made] == ["cpu"] * len(made)
    assert on_meta.is_meta, "non-CUDA devices pass through"
    with pytest.raises((AssertionError, RuntimeError), match=NO_CUDA):
        torch.zeros(1, device="cuda")


@in_process_without_cuda
def test_tensor_type_has_the_cuda_spelling_inside_the_scope_only():
    x = torch.ones(1)
    with cuda_factories_on_cpu():
        assert x.type() == "torch.cuda.FloatTensor"
        assert x.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert x.type(torch.float64).dtype == torch.float64, "the casting form of type() is untouched"
    assert x.type() == "torch.FloatTensor"


@pytest.mark.gpu
def test_layer_is_a_no_op_where_cuda_exists():
    current_device = torch.cuda.current_device
    assert apply_cpu_compat() is False
    assert torch.cuda.current_device is current_device
    with cuda_factories_on_cpu():
        assert torch.zeros(1, device="cuda").is_cuda


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return run_distributed(compat_cases, 2, args=(str(tmp_path_factory.mktemp("ckpt")),), timeout_s=240)


# --- assertions -------------------------------------------------------------------------------------------

def _assert_fails_without(case, site_file):
    assert case is not None, "the megatron call worked without the patch: the patch is not needed"
    assert re.search(NO_CUDA, case["error"]), case
    assert case["site"].startswith(site_file), case


def test_layer_is_applied_once(per_rank):
    for r in per_rank:
        assert all(r["patched"])
        assert r["apply_again"] and r["apply_again_kept_patch"] and r["rng_log_filters"] == 1
        assert r["current_device"] == "cpu"


@pytest.mark.numerics
def test_current_device_column_parallel_gather_output_at_tp2(per_rank):
    for r in per_rank:
        case = r["column_parallel"]
        _assert_fails_without(case["without"], "tensor_parallel/mappings.py")
        assert case["out_diff"] < 1e-5 and case["dgrad_diff"] < 1e-5 and case["wgrad_diff"] < 1e-5, case


def test_rng_tracker_fork_is_reproducible_and_tp_rank_specific(per_rank):
    rank0, rank1 = (r["rng"] for r in per_rank)
    for case in (rank0, rank1):
        assert case["first"] == case["again"], "same seed, same draws"
        assert case["first"]["default_stream_kept"], "fork() must restore the default stream"
    assert rank0["first"]["forked"] != rank1["first"]["forked"], "TP ranks draw from different seeds in fork()"


def test_rng_fails_or_goes_wrong_without_each_rng_patch(per_rank):
    rank0, rank1 = (r["rng"] for r in per_rank)
    _assert_fails_without(rank0["without_get_rng_state"], "tensor_parallel/random.py")
    assert not rank0["without_set_rng_state"]["default_stream_kept"], "without _set_cuda_rng_state fork() is a no-op"
    assert rank0["without_manual_seed"]["forked"] == rank1["without_manual_seed"]["forked"], (
        "without torch.cuda.manual_seed every tracked state is the same"
    )


def test_fork_warning_is_filtered_only_for_the_rng_routing(per_rank):
    for r in per_rank:
        assert r["rng"]["fork_warnings"] == []
        assert r["rng"]["fork_warnings_without_filter"] == ["CPU RNG state changed within GPU RNG context"]


def test_checkpoint_saved_at_tp2_loads_exactly_at_tp1(per_rank):
    for r in per_rank:
        save = r["checkpoint_save"]
        _assert_fails_without(save["without_synchronize"], "dist_checkpointing/strategies/filesystem_async.py")
        _assert_fails_without(save["without_current_device"], "dist_checkpointing/strategies/state_dict_saver.py")
        assert r["checkpoint_load"] == {"weight_equal": True, "bias_equal": True}


@pytest.mark.numerics
def test_ddp_finish_grad_sync_averages_over_dp(per_rank):
    for r in per_rank:
        _assert_fails_without(r["ddp"]["without"], "distributed/param_and_grad_buffer.py")
        assert r["ddp"]["main_grad_vs_mean_grad"] < 1e-6


@pytest.mark.numerics
def test_schedule_pp1_with_custom_loss_func(per_rank):
    for r in per_rank:
        case = r["schedule"]
        _assert_fails_without(case["without"], "pipeline_parallel/schedules.py")
        assert case["losses"] == pytest.approx(case["ref_losses"], abs=1e-6)
        assert case["views"] == pytest.approx([loss / 3 for loss in case["ref_losses"]], abs=1e-6)
        assert case["grad_diff"] < 1e-6


@pytest.mark.numerics
def test_distributed_optimizer_matches_plain_adam_with_clipping(per_rank):
    for r in per_rank:
        case = r["optimizer"]
        _assert_fails_without(case["without"], "optimizer/")
        assert case["norms"] == pytest.approx(case["ref_norms"], rel=1e-5)
        assert min(case["ref_norms"]) > 0.5, "the clip must be active for this test to mean anything"
        assert case["param_diff"] < 1e-5


def test_fp32_clip_type_assert_needs_the_scope(per_rank):
    case = per_rank[0]["clip"]
    assert case["without"]["error"].startswith("AssertionError") and case["without"]["site"] == "optimizer/clip_grads.py:174"
    assert case["clipped"] == pytest.approx([0.5, 0.5], rel=1e-5)
