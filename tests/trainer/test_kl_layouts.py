"""FlowGRPO's KL to the reference policy (``algorithm.kl_beta > 0``) at PP=2 on 2 gloo ranks against the single-process
run (test_loop_layouts' shrunk digits run, its helpers and float32 tolerances).  The single process runs the reference
inline in each training forward; under PP it is a forward-only pass of the schedule before training with the
reference's weights in place (FlowGRPO.with_reference_means): full fine-tuning swaps the initial weights in (the
algorithm's checkpointed state), LoRA switches the adapters off on every chunk, and with true CFG the pass runs the
reference's own uncond rows while the first optimizer step reuses the rollout's; GRPO-Guard's loss (old_policy.py)
reads the same means.  Step 0 trains at the initial weights
(KL 0); step 1's KL and its gradient are the reference's."""
from __future__ import annotations

import pytest

from megatron_omni.parallel.testing import run_distributed
from tests.trainer.test_loop_layouts import TINY, _close, _train, train_layouts

pytestmark = [pytest.mark.numerics, pytest.mark.slow]  # slow: not rerun under avx2 (make test)

KL = TINY + ["algorithm.kl_beta=0.5"]
CASES = {"full": [], "lora_cfg": ["lora.rank=4", "lora.alpha=8", "train.lr=1e-3", "rollout.guidance_scale=3.0"],
         # the loss against the old policy's means (algorithms.old_policy): μ_old's pass, then μ_ref's
         "grpo_guard": ["algorithm.name=grpo_guard"],
         # interleaved: the reference pass's stage-boundary shape (its own uncond rows) is not the first optimizer
         # step's (the rollout's reused); each pass gets its own (Run.boundary_shape)
         "lora_cfg_vpp2": ["model.arch.num_layers=4", "lora.rank=4", "lora.alpha=8", "train.lr=1e-3",
                           "rollout.guidance_scale=3.0"]}  # (4 blocks: one per virtual stage; the later setting wins)
LAYOUTS = {"lora_cfg_vpp2": {"pp": 2, "vpp": 2}}


@pytest.fixture(scope="module")
def at_layouts(tmp_path_factory):
    return layouts_and_one_process({n: (KL + o, LAYOUTS.get(n, {"pp": 2})) for n, o in CASES.items()},
                                   tmp_path_factory.mktemp("kl"))


@pytest.mark.parametrize("name", list(CASES))
def test_kl_at_pp2_equals_one_process(at_layouts, name):
    """PP2 (PP2 x vpp2 for the interleaved case) on 2 gloo ranks: 2 RL steps equal the single process's."""
    single = layout_equals_one_process(*at_layouts[name])
    assert single[0]["kl"] == 0 and single[1]["kl"] > 0 and single[1]["grad_norm"] > 0


def layouts_and_one_process(runs: dict[str, tuple[list[str], dict]], root) -> dict[str, tuple[list[dict], list]]:
    """2 RL steps of every run of ``runs`` (name -> (overrides, layout)) in one process each, and all of them at
    their layouts in one launch of 2 gloo ranks (a launch costs seconds): name -> (the single process's metrics,
    each rank's)."""
    from megatron_omni.parallel.state import destroy_parallel, init_parallel

    single = {}
    for name, (overrides, _) in runs.items():
        state = init_parallel(tp=1, seed=0, device="cpu")
        try:
            single[name] = _train(state, overrides, root / "single" / name)
        finally:
            destroy_parallel()
    ranks = run_distributed(train_layouts, world_size=2, timeout_s=900,
                            args=({n: (layout, o) for n, (o, layout) in runs.items()}, root / "layout"))
    return {name: (single[name], [r[name] for r in ranks]) for name in runs}


def layout_equals_one_process(single: list[dict], ranks: list[list[dict]]) -> list[dict]:
    """The ranks agree and equal the single process (test_loop_layouts' tolerances); the single process's metrics."""
    assert ranks[0] == ranks[1]
    _close(ranks[0], single)
    return single


def test_kl_checkpoint_at_one_process_resumes_at_pp2(tmp_path):
    """Full fine-tuning with the KL, killed in one process after step 1 (checkpoint after step 0), resumed at PP2: the
    reference pass's initial weights are the run's own (its seed), not the checkpoint's, so steps 1 and 2 equal the
    uninterrupted single-process run's."""
    whole, resumed = resumed_at_pp2(KL, tmp_path)
    assert whole[2]["kl"] > 0
    _close_steps(resumed, whole[1:])


def resumed_at_pp2(overrides: list[str], tmp_path) -> tuple[list[dict], list[dict]]:
    """``overrides`` as a 3-step run: uninterrupted in one process, and killed after step 0's checkpoint in one
    process then resumed at PP2 on 2 gloo ranks; (the uninterrupted run's metrics, the resumed run's steps 1-2)."""
    from megatron_omni.parallel.state import destroy_parallel, init_parallel
    from tests.trainer.test_loop_layouts import _killed, _resumed

    three = [o for o in overrides if not o.startswith(("train.steps", "train.save_every"))] + [
        "train.steps=3", "train.save_every=1"]
    state = init_parallel(tp=1, seed=0, device="cpu")
    try:
        whole = _train(state, three, tmp_path / "whole")
        assert _killed(state, three, tmp_path / "run") == "0"
    finally:
        destroy_parallel()
    ranks = run_distributed(_resumed, world_size=2, parallel={"pp": 2}, args=(three + ["parallel.pp=2"],
                                                                               tmp_path / "run"), timeout_s=600)
    assert ranks[0] == ranks[1] and [m["step"] for m in ranks[0]] == [1, 2]
    return whole, ranks[0]


def _close_steps(got: list[dict], want: list[dict]) -> None:
    from tests.trainer.test_loop_layouts import ABS, REL

    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=REL, abs=ABS), (a["step"], key)
