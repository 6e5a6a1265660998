"""init_parallel: layout errors before anything starts, and the groups megatron builds for each layout."""
import os

import pytest
import torch
import torch.distributed as dist

from megatron_omni.parallel import destroy_parallel, init_parallel
from megatron_omni.parallel.state import TORCHRUN_ENV
from megatron_omni.parallel.testing import run_distributed


@pytest.fixture
def no_torchrun_env(monkeypatch):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tp": 2}, r"world size 1 is not divisible by tp\*cp\*pp = 2\*1\*1 = 2"),
        ({"cp": 3, "pp": 2}, r"world size 1 is not divisible by tp\*cp\*pp = 1\*3\*2 = 6"),
        ({"tp": 0}, "tp must be a positive int, got 0"),
        ({"pp": "2"}, "pp must be a positive int, got '2'"),
        ({"vpp": 0}, "vpp must be None or a positive int, got 0"),
        ({"device": "tpu"}, r"device 'tpu' is not one of"),
    ],
)
def test_bad_layout_is_rejected_before_any_process_group(no_torchrun_env, kwargs, message):
    with pytest.raises(ValueError, match=message):
        init_parallel(**kwargs)
    assert not dist.is_initialized()


def test_world_size_from_torchrun_env_is_checked(monkeypatch):
    env = {"RANK": "0", "WORLD_SIZE": "6", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp\*cp\*pp = 2\*1\*4 = 8"):
        init_parallel(tp=2, pp=4)
    assert not dist.is_initialized()


def test_incomplete_torchrun_env_is_an_error(no_torchrun_env, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"\['RANK'\] are set but \['WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR'"):
        init_parallel()


def _summary(state):
    return {
        "sizes": (state.world_size, state.tp, state.cp, state.pp, state.dp, state.vpp),
        "ranks": (state.rank, state.tp_rank, state.cp_rank, state.pp_rank, state.dp_rank),
        "group_sizes": tuple(dist.get_world_size(g) for g in (state.tp_group, state.cp_group,
                                                               state.pp_group, state.dp_group)),
        "collection_is_same_groups": state.pg_collection.tp is state.tp_group
        and state.pg_collection.pp is state.pp_group and state.pg_collection.dp is state.dp_group,
        "device": (state.device.type, state.device.backend, str(state.torch_device)),
    }


LAYOUTS = [{"tp": 2}, {"cp": 2}, {"pp": 2}, {"pp": 2, "vpp": 2}, {}]


def _layouts_then_single_process():
    """Every layout of 2 ranks on one default group, then each rank alone with no torchrun env."""
    out = {}
    for layout in LAYOUTS:
        state = init_parallel(**layout, seed=3)
        out[str(layout)] = _summary(state)
        out[str(layout)]["first_draw"] = torch.rand(1).item()
        destroy_parallel(keep_default_group=True)
    destroy_parallel()
    out["default_group_destroyed"] = not dist.is_initialized()
    for name in TORCHRUN_ENV:
        del os.environ[name]
    out["single"] = _summary(init_parallel())
    destroy_parallel()
    return out


@pytest.fixture(scope="module")
def per_rank():
    return run_distributed(_layouts_then_single_process, 2, timeout_s=120)


@pytest.mark.parametrize(
    "layout, sizes, group_sizes, ranks_of_rank_1",
    [
        ({"tp": 2}, (2, 2, 1, 1, 1, None), (2, 1, 1, 1), (1, 1, 0, 0, 0)),
        ({"cp": 2}, (2, 1, 2, 1, 1, None), (1, 2, 1, 1), (1, 0, 1, 0, 0)),
        ({"pp": 2}, (2, 1, 1, 2, 1, None), (1, 1, 2, 1), (1, 0, 0, 1, 0)),
        ({"pp": 2, "vpp": 2}, (2, 1, 1, 2, 1, 2), (1, 1, 2, 1), (1, 0, 0, 1, 0)),
        ({}, (2, 1, 1, 1, 2, None), (1, 1, 1, 2), (1, 0, 0, 0, 1)),
    ],
)
def test_layout_groups_and_ranks(per_rank, layout, sizes, group_sizes, ranks_of_rank_1):
    rank0, rank1 = (r[str(layout)] for r in per_rank)
    for summary in (rank0, rank1):
        assert summary["sizes"] == sizes
        assert summary["group_sizes"] == group_sizes
        assert summary["collection_is_same_groups"]
        assert summary["device"] == ("cpu", "gloo", "cpu")
    assert rank0["ranks"] == (0, 0, 0, 0, 0)
    assert rank1["ranks"] == ranks_of_rank_1
    assert rank0["first_draw"] == rank1["first_draw"], "the default RNG stream is seeded alike on all ranks"


def test_without_torchrun_env_each_process_is_its_own_world(per_rank):
    for summary in per_rank:
        assert summary["default_group_destroyed"]
        assert summary["single"]["sizes"] == (1, 1, 1, 1, 1, None)
        assert summary["single"]["ranks"] == (0, 0, 0, 0, 0)


def _nccl_summary(state):
    total = torch.ones(1, device=state.torch_device) * (state.rank + 1)
    dist.all_reduce(total, group=state.tp_group)
    return {
        "device": (state.device.type, state.device.backend, str(state.torch_device)),
        "current_device": torch.cuda.current_device(),
        "sum": total.item(),
    }


@pytest.mark.gpu
def test_nccl_ranks_bind_one_gpu_each():
    world = min(torch.cuda.device_count(), 2)
    results = run_distributed(_nccl_summary, world, backend="nccl", parallel={"tp": world}, timeout_s=120)
    assert [r["device"] for r in results] == [("cuda", "nccl", f"cuda:{rank}") for rank in range(world)]
    assert [r["current_device"] for r in results] == list(range(world))
    assert all(r["sum"] == world * (world + 1) / 2 for r in results)
