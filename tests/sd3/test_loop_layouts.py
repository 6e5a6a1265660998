"""The SD3 family through the RL loop at a parallel layout: one step of ``sd35_flow_grpo`` (LoRA on the joint attention,
CPS, the folder's CLIP-L / CLIP-G / T5 text encoders with the pooled text as the denoiser's text extra, its VAE) on a
tiny StableDiffusion3Pipeline folder at TP2 and at PP2 on 2 gloo ranks equals the single-process step, within
test_loop_layouts' float32 tolerances (TP splits the GEMMs' sums; PP runs the same sums on two ranks)."""
from __future__ import annotations

import pytest

from megatron_omni.parallel.testing import run_distributed
from tests.trainer.test_loop_layouts import ABS, REL, TIMING, train_layouts

pytestmark = [pytest.mark.numerics, pytest.mark.slow]  # slow: not rerun under avx2 (make test)

SD3 = ["model.dtype=float32", "data.height=64", "data.width=64", "data.eval_prompts=4", "rollout.prompts_per_step=2",
       "rollout.group_size=4", "rollout.num_steps=4", "rollout.window_range=[0,1]", "lora.rank=4", "lora.alpha=8",
       "train.lr=1e-3", "train.micro_batch_size=4", "train.global_batch_size=8", "train.steps=1", "train.save_every=0",
       "train.eval_every=0", "algorithm.logprob_check_samples=4", "logging.wandb_mode=disabled",
       "reward.name=jpeg_compressibility", "reward.workers=1"]
LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2}}


def _train_sd3(state, overrides, out):
    import torch

    from megatron_omni.config import load_config
    from megatron_omni.data.tasks import task_for
    from megatron_omni.trainer.loop import train

    torch.set_num_threads(1)
    cfg = load_config("sd35_flow_grpo", None, overrides)
    _, done = train(cfg, state, task_for(cfg, state.torch_device), out)
    return [{k: v for k, v in m.items() if k not in TIMING} for m in done]


@pytest.fixture(scope="module")
def folder_and_single(tmp_path_factory):
    from megatron_omni.parallel.state import destroy_parallel, init_parallel
    from megatron_omni.testing.tiny_pipelines import build_sd3_pipeline

    root = tmp_path_factory.mktemp("sd3_layouts")
    overrides = SD3 + [f"model.path={build_sd3_pipeline(root / 'sd3', seed=0)}"]
    state = init_parallel(tp=1, seed=0, device="cpu")
    try:
        single = _train_sd3(state, overrides, root / "single")
    finally:
        destroy_parallel()
    assert single[0]["grad_norm"] > 0 and single[0]["reward_std"] > 0
    return overrides, single


@pytest.fixture(scope="module")
def two_ranks(folder_and_single, tmp_path_factory):
    """Both layouts in one launch of 2 gloo ranks: per rank {name: metrics}."""
    runs = {name: (layout, folder_and_single[0]) for name, layout in LAYOUTS.items()}
    return run_distributed(train_layouts, world_size=2, timeout_s=900,
                           args=(runs, tmp_path_factory.mktemp("sd3_ranks")), kwargs={"train": _train_sd3})


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sd3_recipe_at_two_ranks_equals_one_process(folder_and_single, two_ranks, name):
    single = folder_and_single[1]
    ranks = [r[name] for r in two_ranks]
    assert ranks[0] == ranks[1] and [m["step"] for m in ranks[0]] == [0]
    assert ranks[0][0].keys() == single[0].keys()
    for key in single[0]:
        assert ranks[0][0][key] == pytest.approx(single[0][key], rel=REL, abs=ABS), key
