"""Every registered algorithm at PP=2 with vpp=2 (interleaved 1F1B) on 2 gloo ranks: test_algorithm_pp2's shrunk
digits run at 4 blocks (4 chunks, 2 per rank) and micro-batches of 2 rows, so that every pass of the schedule
(training, the log-prob check, a reference or old-policy pass) has at least pp micro-batches, as the interleaved
schedule needs (Run.run_microbatches refuses fewer, naming the settings).  Both ranks report the last stage's
metrics alike; every algorithm's fixed stage-boundary shape comes from Run.boundary_shape."""
from __future__ import annotations

import math

import pytest

from megatron_omni.algorithms import algorithm_names
from megatron_omni.parallel.testing import run_distributed
from tests.algorithms.test_algorithm_pp2 import OWN, TIMING, TINY

pytestmark = [pytest.mark.numerics, pytest.mark.slow]  # slow: not rerun under avx2 (make test)

VPP = [o for o in TINY if not o.startswith(("model.arch.num_layers", "train.micro_batch_size"))]
VPP += ["model.arch.num_layers=4", "train.micro_batch_size=2", "parallel.vpp=2"]


def _every_algorithm(state, names, root):
    import torch

    from megatron_omni.config import load_config
    from megatron_omni.data.tasks import build_task
    from megatron_omni.trainer.loop import train

    torch.set_num_threads(1)
    task, out = build_task("digits"), {}
    for name in names:
        cfg = load_config("digits_flow_grpo", None, [f"algorithm.name={name}", *VPP, *OWN.get(name, [])])
        _, done = train(cfg, state, task, root / name)
        out[name] = [{k: v for k, v in m.items() if k not in TIMING} for m in done]
    return out


def test_every_algorithm_runs_at_pp2_vpp2(tmp_path):
    names = algorithm_names()
    ranks = run_distributed(_every_algorithm, world_size=2, parallel={"pp": 2, "vpp": 2}, args=(names, tmp_path),
                            timeout_s=1200)
    assert ranks[0] == ranks[1]
    for name in names:
        done = ranks[0][name]
        assert [m["step"] for m in done] == [0, 1], name
        for m in done:
            assert math.isfinite(m["loss"]) and m["grad_norm"] > 0 and m["optimizer_steps"] >= 1, (name, m)
