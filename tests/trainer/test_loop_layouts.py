"""The RL loop (``megatron_omni.trainer.loop.train``) on 2 gloo ranks against the single-process run of the same
config: DP=2 (each replica samples, scores and trains its own half of the step's prompt groups; the step's
metrics are over both) and TP=2 (one replica; every TP rank's in-process engine holds the whole model).

One optimizer step per RL step (global_batch_size = the step's 16 pairs): then its gradient is the same mean
over the same pairs in every layout.  (With several, an optimizer step takes global_batch_size / DP pairs from
each replica's own groups, so its pairs are not the single-process run's: like megatron's data-parallel sampler,
not like one process.)  Tolerances: DP=2 splits the optimizer step's micro-batches over the replicas and DDP sums their gradients in
another order (float32, ~1e-7 relative per step, amplified by Adam's first steps); TP=2 splits the GEMMs' sums.
The rollout of the first step is the same computation in every layout (equal weights), so its rewards agree
to rounding; the second starts from weights that differ by that rounding."""
from __future__ import annotations

import json

import pytest

from megatron_omni.parallel.testing import run_distributed
from megatron_omni.trainer.loop import TIMING_METRICS as TIMING

pytestmark = [pytest.mark.numerics, pytest.mark.slow]  # slow: not rerun under avx2 (make test)

TINY = ["train.steps=2", "train.save_every=0", "train.micro_batch_size=4", "train.global_batch_size=16",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.num_steps=4", "rollout.window_size=2",
        "algorithm.logprob_check_samples=4", "logging.wandb_mode=disabled", "model.arch.num_layers=2",
        "reward.workers=1"]
REL, ABS = 1e-4, 1e-6


def _train(state, overrides, out):
    import torch

    from megatron_omni.config import load_config
    from megatron_omni.data.tasks import build_task
    from megatron_omni.trainer.loop import train

    torch.set_num_threads(1)
    _, done = train(load_config("digits_flow_grpo", None, overrides), state, build_task("digits"), out)
    return [{k: v for k, v in m.items() if k not in TIMING} for m in done]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    from megatron_omni.parallel.state import destroy_parallel, init_parallel

    state = init_parallel(tp=1, seed=0, device="cpu")
    try:
        return _train(state, TINY, tmp_path_factory.mktemp("single") / "run")
    finally:
        destroy_parallel()


def train_layouts(runs, root, train=_train):
    """Every run of ``runs`` (name -> (init_parallel's arguments, overrides)) trained by ``train`` in one launch, its
    groups laid out again on the same ranks (a launch costs seconds, the run a fraction): name -> this rank's
    metrics."""
    import torch.distributed as dist

    from megatron_omni.parallel.state import destroy_parallel, init_parallel

    metrics = {}
    for name, (layout, overrides) in runs.items():
        state = init_parallel(**layout, device="cpu")
        metrics[name] = train(state, overrides + [f"parallel.{k}={v}" for k, v in layout.items()], root / name)
        destroy_parallel(keep_default_group=True)
    dist.destroy_process_group()
    return metrics


def _launch(tmp_path_factory, runs, world_size):
    """(root, per rank {name: metrics}) of ``train_layouts(runs)`` on ``world_size`` ranks; run root / name."""
    root = tmp_path_factory.mktemp(f"ranks{world_size}")
    return root, run_distributed(train_layouts, world_size=world_size, args=(runs, root), timeout_s=900)


def _close(got: list[dict], want: list[dict], rel: float = REL, abs_: float = ABS) -> None:
    """Two runs' metrics of steps 0 and 1: the same keys, every value within ``rel`` / ``abs_``."""
    assert [m["step"] for m in got] == [m["step"] for m in want] == [0, 1]
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=rel, abs=abs_), (a["step"], key)


LAYOUTS = {"dp2": {"tp": 1}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "cp2_ulysses": {"cp": 2, "ulysses": 2},
           "cp2_ring": {"cp": 2}}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every 2-rank run of this file in one launch: the shrunk run at LAYOUTS, LoRA at TP2, 4 blocks at PP2 x vpp2."""
    runs = {**{n: (layout, TINY) for n, layout in LAYOUTS.items()}, "lora_tp2": ({"tp": 2}, LORA),
            "pp2_vpp2": ({"pp": 2, "vpp": 2}, FOUR_BLOCKS)}
    return _launch(tmp_path_factory, runs, 2)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loop_at_two_ranks_equals_one_process(single, two_ranks, name):
    root, per_rank = two_ranks
    ranks, out = [r[name] for r in per_rank], root / name
    assert ranks[0] == ranks[1]  # every rank reports the step's metrics alike
    _close(ranks[0], single)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1]  # one writer
    assert single[0]["optimizer_steps"] == 1 and single[0]["reward_std"] > 0 and single[1]["grad_norm"] > 0


def test_dp_shards_whole_groups_without_repeats():
    from megatron_omni.rollout.engine import Request
    from megatron_omni.trainer.data_parallel import shard_requests

    requests = [Request(prompt=f"p{k}", prompt_id=k, seed=10 * k + i) for k in range(6) for i in range(3)]
    shards = [shard_requests(requests, 3, r) for r in range(3)]
    assert [[q.prompt_id for q in s] for s in shards] == [[0] * 3 + [1] * 3, [2] * 3 + [3] * 3, [4] * 3 + [5] * 3]
    assert sorted(q.seed for s in shards for q in s) == sorted(q.seed for q in requests)
    with pytest.raises(ValueError, match="6 prompt groups in an RL step for 4 data-parallel replicas"):
        shard_requests(requests, 4, 0)
    uneven = [shard_requests(requests, 4, r, even=False) for r in range(4)]
    assert [len(s) // 3 for s in uneven] == [2, 2, 1, 1]


def test_layout_that_does_not_split_is_one_clear_error():
    from megatron_omni.config import load_config
    from megatron_omni.trainer.run import check_data_parallel

    cfg = load_config("digits_flow_grpo", None, TINY)
    check_data_parallel(cfg, 2)
    with pytest.raises(ValueError, match="rollout.prompts_per_step=2 prompt groups per RL step over 4"):
        check_data_parallel(cfg, 4)
    with pytest.raises(ValueError, match="train.global_batch_size=16 pairs per optimizer step over 8"):
        check_data_parallel(load_config("digits_flow_grpo", None, TINY + ["rollout.prompts_per_step=8"]), 8)


def _killed(state, overrides, out):
    """The run killed after its second step (its latest checkpoint: after the first)."""
    import torch

    from megatron_omni.config import load_config
    from megatron_omni.data.tasks import build_task
    from megatron_omni.trainer.loop import train

    torch.set_num_threads(1)
    train(load_config("digits_flow_grpo", None, overrides), state, build_task("digits"), out, stop_after=2)
    return (out / "checkpoints" / "latest").read_text().strip()


def _resumed(state, overrides, out):
    import torch

    from megatron_omni.config import load_config
    from megatron_omni.data.tasks import build_task
    from megatron_omni.trainer.loop import train

    torch.set_num_threads(1)
    _, done = train(load_config("digits_flow_grpo", None, overrides), state, build_task("digits"), out, resume=True)
    return [{k: v for k, v in m.items() if k not in TIMING} for m in done]


def test_checkpoint_at_tp2_resumes_at_pp2(tmp_path):
    """Killed at TP=2 after step 1 (checkpoint after step 0), resumed at TP=1 x PP=2 (dist-checkpointing reshards
    the model and the optimizer): steps 1 and 2 equal the uninterrupted single-process run's (which the PP=2 and
    TP=2 runs equal, test above)."""
    from megatron_omni.parallel.state import destroy_parallel, init_parallel

    three = [o for o in TINY if not o.startswith(("train.steps", "train.save_every"))] + ["train.steps=3",
                                                                                          "train.save_every=1"]
    state = init_parallel(tp=1, seed=0, device="cpu")
    try:
        whole = _train(state, three, tmp_path / "whole")
    finally:
        destroy_parallel()
    out = tmp_path / "run"
    assert run_distributed(_killed, world_size=2, parallel={"tp": 2}, args=(three + ["parallel.tp=2"], out),
                           timeout_s=600) == ["0", "0"]
    ranks = run_distributed(_resumed, world_size=2, parallel={"pp": 2}, args=(three + ["parallel.pp=2"], out),
                            timeout_s=600)
    assert ranks[0] == ranks[1] and [m["step"] for m in ranks[0]] == [1, 2]
    for a, b in zip(ranks[0], whole[1:]):
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=REL, abs=ABS), (a["step"], key)


FOUR_RANKS = {"tp2_pp2": {"tp": 2, "pp": 2}, "dp2_tp2": {"tp": 2}, "cp2_ulysses_pp2": {"cp": 2, "ulysses": 2, "pp": 2}}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, {n: (layout, TINY) for n, layout in FOUR_RANKS.items()}, 4)


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_loop_on_four_ranks_equals_one_process(single, four_ranks, name):
    """TP2 x PP2, DP2 x TP2 (two replicas of a TP pair: each samples and trains its half of the groups) and
    CP2 (Ulysses) x PP2 on 4 gloo ranks (one launch for the three)."""
    ranks = [r[name] for r in four_ranks[1]]
    assert all(r == ranks[0] for r in ranks)
    _close(ranks[0], single)


LORA = TINY + ["lora.rank=4", "lora.alpha=8", "train.lr=1e-3"]
FOUR_BLOCKS = [o for o in TINY if not o.startswith("model.arch.num_layers")] + ["model.arch.num_layers=4"]


def test_lora_loop_at_tp2_equals_one_process(two_ranks, tmp_path):
    """LoRA at TP=2: the adapters' split matrices (B of a column-parallel linear, A of a row-parallel one) carry
    megatron's TP attributes, so the gradient norm counts every rank's shard (it was TP rank 0's alone: 2.23e-4
    against 2.58e-4 on a tiny SD3 run)."""
    from megatron_omni.parallel.state import destroy_parallel, init_parallel

    state = init_parallel(tp=1, seed=0, device="cpu")
    try:
        single = _train(state, LORA, tmp_path / "single")
    finally:
        destroy_parallel()
    ranks = [r["lora_tp2"] for r in two_ranks[1]]
    assert ranks[0] == ranks[1] and single[0]["grad_norm"] > 0
    _close(ranks[0], single)


def test_loop_at_pp2_vpp2_equals_one_process(two_ranks, tmp_path):
    """Interleaved PP (vpp=2): 4 blocks in 4 chunks, 2 per rank (megatron's chunk order); the interleaved schedule
    gets its fixed stage-boundary shape from the first stage (Run.boundary_shape), the weight export reads every
    chunk (each stage's, chunk by chunk), and the last step's checkpoint holds both chunks of each rank."""
    from megatron_omni.parallel.state import destroy_parallel, init_parallel

    state = init_parallel(tp=1, seed=0, device="cpu")
    try:
        single = _train(state, FOUR_BLOCKS, tmp_path / "single")
    finally:
        destroy_parallel()
    out, ranks = two_ranks[0] / "pp2_vpp2", [r["pp2_vpp2"] for r in two_ranks[1]]
    assert ranks[0] == ranks[1] and single[1]["grad_norm"] > 0
    _close(ranks[0], single)
    assert (out / "checkpoints" / "latest").read_text().strip() == "1"


def test_checkpoint_at_pp2_vpp2_resumes_at_tp2(tmp_path):
    """Killed at PP2 x vpp2 after step 1 (checkpoint after step 0: both chunks of each rank, the timestep embedder
    written once), resumed at TP2: steps 1 and 2 equal the uninterrupted single-process run's."""
    from megatron_omni.parallel.state import destroy_parallel, init_parallel

    three = [o for o in TINY if not o.startswith(("train.steps", "train.save_every", "model.arch.num_layers"))]
    three += ["train.steps=3", "train.save_every=1", "model.arch.num_layers=4"]
    state = init_parallel(tp=1, seed=0, device="cpu")
    try:
        whole = _train(state, three, tmp_path / "whole")
    finally:
        destroy_parallel()
    out = tmp_path / "run"
    assert run_distributed(_killed, world_size=2, parallel={"pp": 2, "vpp": 2},
                           args=(three + ["parallel.pp=2", "parallel.vpp=2"], out), timeout_s=600) == ["0", "0"]
    ranks = run_distributed(_resumed, world_size=2, parallel={"tp": 2}, args=(three + ["parallel.tp=2"], out),
                            timeout_s=600)
    assert ranks[0] == ranks[1] and [m["step"] for m in ranks[0]] == [1, 2]
    for a, b in zip(ranks[0], whole[1:]):
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=REL, abs=ABS), (a["step"], key)


PIPELINE = ["model.dtype=float32", "data.height=64", "data.width=64", "data.eval_prompts=4",
            "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.num_steps=4", "rollout.window_range=[0,1]",
            "lora.rank=4", "lora.alpha=8", "train.lr=1e-3", "train.micro_batch_size=4", "train.global_batch_size=8",
            "train.steps=1", "train.save_every=0", "train.eval_every=0", "algorithm.logprob_check_samples=4",
            "logging.wandb_mode=disabled", "reward.name=jpeg_compressibility", "reward.workers=1"]


def _train_pipeline(state, overrides, out):
    import torch

    from megatron_omni.config import load_config
    from megatron_omni.data.tasks import task_for
    from megatron_omni.trainer.loop import train

    torch.set_num_threads(1)
    cfg = load_config("qwen_image_flow_grpo", None, overrides)
    _, done = train(cfg, state, task_for(cfg, state.torch_device), out)
    return [{k: v for k, v in m.items() if k not in TIMING} for m in done]


def test_pipeline_recipe_at_tp2_pp2_on_four_ranks_equals_one_process(tmp_path):
    """One step of qwen_image_flow_grpo (LoRA, true CFG, the folder's text encoder and VAE) on a tiny pipeline
    folder at TP2 x PP2 equals the single-process step; the single-process run parks the text encoder and VAE and
    keeps its trajectories on the host (no-ops on a CPU, the code paths of data.offload_encoders and
    rollout.trajectories_on all the same)."""
    from megatron_omni.parallel.state import destroy_parallel, init_parallel
    from megatron_omni.testing.tiny_pipelines import build_qwen_image_pipeline

    overrides = PIPELINE + [f"model.path={build_qwen_image_pipeline(tmp_path / 'qwen', seed=0)}"]
    state = init_parallel(tp=1, seed=0, device="cpu")
    try:
        single = _train_pipeline(state, overrides + ["data.offload_encoders=true", "rollout.trajectories_on=host"],
                                 tmp_path / "single")
    finally:
        destroy_parallel()
    assert single[0]["grad_norm"] > 0 and single[0]["reward_std"] > 0
    ranks = run_distributed(_train_pipeline, world_size=4, parallel={"tp": 2, "pp": 2},
                            args=(overrides + ["parallel.tp=2", "parallel.pp=2"], tmp_path / "tp2_pp2"),
                            timeout_s=900)
    assert all(r == ranks[0] for r in ranks) and [m["step"] for m in ranks[0]] == [0]
    for key in single[0]:
        assert ranks[0][0][key] == pytest.approx(single[0][key], rel=REL, abs=ABS), key
