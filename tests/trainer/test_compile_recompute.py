"""``train.recompute`` (full | selective) together with ``train.compile``: the digits loop with the policy's blocks
compiled (inductor's CPU backend) and recomputed gives the compiled run's metrics without recompute.  A recomputed
slice of blocks is the compiled graph run again inside the backward (full: the block runner checkpoints around the
compiled call; selective: the core attention's checkpoint traced into the block's graph), so the metrics agree to
float32 rounding; tolerances are test_memory_settings' (rel 1e-5, abs 1e-7)."""
from __future__ import annotations

import pytest

from tests.trainer.test_memory_settings import _equal, _train

pytestmark = [pytest.mark.numerics, pytest.mark.slow,  # slow: not rerun under avx2 (test_memory_settings is, eager)
              pytest.mark.usefixtures("one_torch_thread")]

COMPILED = ["train.compile=default"]


def test_compiled_loop_with_recompute_equals_the_compiled_plain_run(single_rank, tmp_path):
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _, plain = _train(single_rank, COMPILED, tmp_path / "plain")
    assert plain[1]["grad_norm"] > 0
    recomputes = (["train.recompute=full", "train.recompute_num_layers=2"], ["train.recompute=selective"])
    for i, extra in enumerate(recomputes):
        run, got = _train(single_rank, COMPILED + extra, tmp_path / f"run{i}")
        assert run.policy.module.block_runner.recompute_layers == (2 if i == 0 else None)  # the setting reached it
        _equal(got, plain, extra)
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"], dict(counters["graph_break"])
