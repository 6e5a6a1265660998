"""run_distributed itself: results in rank order, failures and hangs surface in the caller."""
import os
import time

import pytest
import torch

from megatron_omni.parallel.testing import RemoteTraceback, run_distributed


def _describe_rank(a, b=0):
    return {
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
        "args": (a, b),
        "omp": os.environ["OMP_NUM_THREADS"],
        "threads": torch.get_num_threads(),
        "cuda_visible": os.environ["CUDA_VISIBLE_DEVICES"],
        "mark": os.environ.get("MEGATRON_OMNI_TEST_MARK"),
        "cwd": os.getcwd(),
    }


def _fail_on_rank_1():
    if os.environ["RANK"] == "1":
        raise ValueError("rank one broke: 42")
    time.sleep(120)  # rank 0 would wait forever for its peer; the helper must not wait for it


def _sleep_forever():
    time.sleep(600)


def _die_on_rank_1():
    if os.environ["RANK"] == "1":
        os._exit(3)
    return "rank 0 done"


def test_results_come_back_in_rank_order_with_args_and_child_settings(monkeypatch, tmp_path):
    results = run_distributed(_describe_rank, 3, args=(7,), kwargs={"b": 8}, timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1, 2]
    for r in results:
        assert r["world_size"] == 3 and r["args"] == (7, 8)
        assert (r["omp"], r["threads"], r["cuda_visible"], r["mark"]) == ("1", 1, "", None)
    # the ranks fork from a server started at the first launch: they still take this launch's environment and cwd
    monkeypatch.setenv("MEGATRON_OMNI_TEST_MARK", "second launch")
    monkeypatch.chdir(tmp_path)
    again = run_distributed(_describe_rank, 2, args=(1,), timeout_s=120)
    assert [(r["mark"], r["cwd"]) for r in again] == [("second launch", str(tmp_path))] * 2


def test_exception_on_rank_1_is_reraised_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(ValueError, match="rank one broke: 42") as info:
        run_distributed(_fail_on_rank_1, 2, timeout_s=100)
    assert time.monotonic() - start < 60, "the sleeping rank 0 was waited for"
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "traceback of rank 1 of 2" in str(info.value.__cause__)
    assert "in _fail_on_rank_1" in str(info.value.__cause__)


def test_hang_is_killed_after_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"_sleep_forever did not finish within timeout_s=3: ranks \[0, 1\]"):
        run_distributed(_sleep_forever, 2, timeout_s=3)
    assert time.monotonic() - start < 30


def test_rank_that_dies_without_a_result_is_reported():
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] exited without a result, exit codes \{1: 3\}"):
        run_distributed(_die_on_rank_1, 2, timeout_s=100)


def test_arguments_are_checked_before_spawning():
    with pytest.raises(TypeError, match="needs a module-level fn"):
        run_distributed(lambda: 0, 2)
    with pytest.raises(ValueError, match=r"backend 'mpi' is not one of \['gloo', 'nccl', 'hccl'\]"):
        run_distributed(_describe_rank, 2, backend="mpi")
    with pytest.raises(ValueError, match="must not set 'device'"):
        run_distributed(_describe_rank, 2, parallel={"tp": 2, "device": "cpu"})
