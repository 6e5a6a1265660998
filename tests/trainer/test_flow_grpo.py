"""The FlowGRPO loop end to end on a tiny digits run: a killed run resumed from its checkpoint continues
exactly as an uninterrupted one; rollout and trainer log-probs agree; the run folder has its outputs."""
import json

import pytest
import torch

from megatron_omni.config import load_config
from megatron_omni.data.tasks import build_task
from megatron_omni.trainer.loop import TIMING_METRICS as TIMING, train

TINY = ["train.steps=4", "train.save_every=2", "train.micro_batch_size=8", "train.global_batch_size=8",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.num_steps=4", "rollout.window_size=2",
        "algorithm.logprob_check_samples=4", "logging.wandb_mode=disabled", "model.arch.num_layers=2"]


@pytest.fixture(scope="module")
def task():
    return build_task("digits")


@pytest.fixture
def passes(monkeypatch):
    """``forward_only`` of every ``run_microbatches`` call the loop makes, in order."""
    from megatron_omni.trainer import build

    calls, run_microbatches = [], build.run_microbatches

    def spy(policy, forward_step, mbs, forward_only=False, **kw):
        calls.append(forward_only)
        return run_microbatches(policy, forward_step, mbs, forward_only=forward_only, **kw)

    monkeypatch.setattr(build, "run_microbatches", spy)
    return calls


def _metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def test_killed_run_resumes_exactly(tmp_path, single_rank, task):
    cfg = load_config("digits_flow_grpo", None, TINY)
    train(cfg, single_rank, task, tmp_path / "whole")
    # the same run killed after step 2 (checkpoint after step 1), then resumed from that checkpoint
    train(cfg, single_rank, task, tmp_path / "killed", stop_after=3)
    assert (tmp_path / "killed" / "checkpoints" / "latest").read_text().strip() == "1"
    assert len(_metrics(tmp_path / "killed")) == 3
    train(cfg, single_rank, task, tmp_path / "killed", resume=True)

    whole, resumed = _metrics(tmp_path / "whole"), _metrics(tmp_path / "killed")
    assert [m["step"] for m in resumed] == [0, 1, 2, 3]
    assert resumed == whole  # rewards, losses, ratios, grad norms: bit for bit
    assert len({m["reward_mean"] for m in whole}) > 1 and whole[-1]["grad_norm"] > 0


def test_bf16_run_checkpoints_and_resumes_exactly(tmp_path, single_rank, task):
    """A bfloat16 run saves and resumes bit for bit.  Every parameter is in the model dtype (the q / k RMSNorms'
    weights too): megatron-core's Float16 optimizer numbers the optimizer state of its fp16 parameters alone, so
    one float32 parameter among them shifted its checkpoint's mapping ("Optimizer shape (32,) does not match model
    shape (128,)" at the first save, seen on the GPU)."""
    cfg = load_config("digits_flow_grpo", None, TINY + ["model.dtype=bfloat16", "train.steps=3", "train.save_every=1"])
    run, _ = train(cfg, single_rank, task, tmp_path / "whole")
    assert {p.dtype for p in run.policy.module.parameters()} == {torch.bfloat16}
    train(cfg, single_rank, task, tmp_path / "killed", stop_after=2)
    train(cfg, single_rank, task, tmp_path / "killed", resume=True)
    whole, resumed = _metrics(tmp_path / "whole"), _metrics(tmp_path / "killed")
    assert [m["step"] for m in resumed] == [0, 1, 2] and resumed == whole


@pytest.mark.numerics
def test_run_folder_and_logprob_consistency(tmp_path, single_rank, task):
    cfg = load_config("digits_flow_grpo", None, TINY + ["train.steps=2"])
    _, done = train(cfg, single_rank, task, tmp_path / "run")
    # the trainer re-scores the rollout in batches of another size: bit for bit where the CPU gives a row the same
    # bits at both sizes (measured here, >= 4 rows), float32 rounding of log π (|log π| ~ 1: ~1e-7) elsewhere.
    # A trainer that scored another step or noise level, or dropped the CFG, is off by >= 1e-2.
    for m in done:
        assert m["logprob_abs_diff"] < 1e-5 and m["logprob_pearson"] > 0.9999
        for key in ("reward_mean", "judge_mean", "zero_std_ratio", "clipfrac_above", "approx_kl", "grad_norm"):
            assert key in m
    names = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"metrics.jsonl", "reward_curve.png", "samples_step00000.png", "checkpoints"} <= names


def test_lora_run_trains_adapters_only_with_kl_to_the_base(tmp_path, single_rank, task):
    cfg = load_config("digits_flow_grpo", None, TINY + ["train.steps=1", "lora.rank=4", "algorithm.kl_beta=0.01"])
    run, done = train(cfg, single_rank, task, tmp_path / "lora")
    trainable = [n for n, p in run.policy.module.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert done[0]["grad_norm"] > 0 and done[0]["kl"] >= 0
    # the engine received merged weights: W + (alpha/r) B A, not the bare base
    assert any(m.delta_weight().abs().max() > 0 for m in __import__("model_specs.common.lora", fromlist=["x"])
               .lora_modules(run.policy.module).values())


CFG = TINY + ["train.steps=2", "rollout.guidance_scale=3.0"]


@pytest.mark.numerics
def test_reused_uncond_first_optimizer_step_only_same_metrics(tmp_path, single_rank, task, monkeypatch):
    """True CFG, 16 pairs in 2 optimizer steps per RL step: the first step (whose forward is also the log-prob
    check: it trains every checked pair) runs on the rollout's uncond outputs, the second recomputes them; the metrics equal those of a run that
    recomputes everywhere to float32 rounding.  Without CFG nothing is kept or reused."""
    from megatron_omni.trainer import build

    seen = []  # per run_microbatches call: (forward only, which micro-batches carry a reused uncond output)

    def spy(policy, forward_step, mbs, forward_only=False, **kw):
        seen.append((forward_only, [mb.uncond_velocity is not None for mb in mbs]))
        return run_microbatches(policy, forward_step, mbs, forward_only=forward_only, **kw)

    run_microbatches = build.run_microbatches
    monkeypatch.setattr(build, "run_microbatches", spy)
    _, reused = train(load_config("digits_flow_grpo", None, CFG), single_rank, task, tmp_path / "reused")
    # per RL step: 2 optimizer steps of 1 micro-batch; the check's 4 samples x 2 steps are the first one's pairs,
    # so it reads that forward's log-probs (no forward-only pass)
    assert seen == [(False, [True]), (False, [False])] * 2
    seen.clear()
    _, recomputed = train(load_config("digits_flow_grpo", None, CFG + ["algorithm.reuse_rollout_uncond=false"]),
                          single_rank, task, tmp_path / "recomputed")
    assert seen == [(False, [False]), (False, [False])] * 2
    # RL step 0: rollouts and weights equal, so what the rollout computed (rewards, advantages) is the same
    # computation in both runs: equal.  The trainer's forwards are not: the reused run's cond rows run as a batch of
    # B rows, the recomputing run's as 2B (cond + uncond).  Where the CPU's kernels give a row the same bits at B and
    # 2B rows (measured here, AMD EPYC: all equal but grad_norm, 7e-13 relative) the metrics agree to ~1e-12; where
    # they do not (an AVX-512 Xeon: policy_loss 1.75e-8 vs -1.23e-8) they differ by float32 rounding of the log-probs,
    # ~1e-7, which true CFG (w = 3) amplifies in the gradients to ~1e-5 (see test_reused_uncond_matches_batched_cfg).
    # Step 1 starts from weights that differ by that rounding (measured worst here: the loss, -3.8e-6 +- 2.3e-10,
    # 6e-5 relative; rewards 2e-8).  So: rel 1e-4, and an absolute floor for the quantities that are ~0 by
    # construction (policy_loss = mean(-A·ρ) with group-centred advantages |A| ~ 1 and ρ - 1 ~ 1e-7..1e-6 from
    # rounding; ratio_std; approx_kl; logprob_abs_diff): 1e-6, at the scale of |A|·(ρ - 1).  A reused uncond output
    # of the wrong pair, step or policy moves log π by >= 1e-2: ratio_mean, approx_kl, logprob_abs_diff and the
    # clip fractions by orders of magnitude more than that.
    rollout_side = {"step", "reward_mean", "reward_std", "judge_mean", "judge_std", "zero_std_ratio", "lr",
                    "optimizer_steps", "sync_restarts"}
    assert rollout_side <= reused[0].keys()
    worst = [0.0, 0.0]
    for step, (a, b) in enumerate(zip(reused, recomputed)):
        assert a.keys() == b.keys() and a["optimizer_steps"] == 2
        for key in a.keys() - set(TIMING):
            worst[step] = max(worst[step], abs(a[key] - b[key]) / max(abs(b[key]), 1e-30))
            if step == 0 and key in rollout_side:
                assert a[key] == b[key], key
            else:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    print(f"reused vs recomputed uncond: worst metric rel diff step 0 {worst[0]:.1e}, step 1 {worst[1]:.1e}")
    seen.clear()
    _, plain = train(load_config("digits_flow_grpo", None, TINY + ["train.steps=1"]), single_rank, task,
                     tmp_path / "no_cfg")
    assert seen == [(False, [False]), (False, [False])]  # the demo's setting: no CFG (the check folded in)


def test_microbatches_take_each_pairs_own_kept_uncond_output():
    """Trajectory.uncond_velocity holds the trained steps in order: pair (i, j) takes slot trained[:j].sum();
    a trajectory that kept none is refused; later optimizer steps drop the reused outputs."""
    import torch

    from megatron_omni.rollout.engine import Request, Trajectory
    from megatron_omni.algorithms.flow_grpo import ALGORITHM
    from megatron_omni.algorithms.flow_grpo.microbatches import grpo_microbatches

    req = Request(prompt="p", guidance_scale=3.0, img_fhw=(1, 1, 2), num_steps=4)
    trained = torch.tensor([False, True, False, True])
    trajs = [Trajectory(req, torch.randn(5, 2, 3), torch.linspace(1, 0, 5), torch.zeros(4), trained,
                        uncond_velocity=torch.arange(12.0).view(2, 2, 3) + 100 * i) for i in range(2)]
    text = {p: (torch.zeros(n, 4), torch.ones(n, dtype=torch.bool)) for p, n in (("p", 3), ("", 2))}
    mbs = grpo_microbatches(trajs, torch.zeros(2), text, size=3, reuse_uncond=True)
    kept = torch.cat([mb.uncond_velocity for mb in mbs])
    assert torch.equal(kept, torch.cat([trajs[0].uncond_velocity, trajs[1].uncond_velocity]))
    steps = ALGORITHM.optimizer_steps(mbs, 1)
    assert [mb.uncond_velocity is not None for (mb,) in steps] == [True, False]
    assert steps[1][0].uncond_rows and steps[1][0].uncond_txt is not None
    trajs[1].uncond_velocity = None
    with pytest.raises(ValueError, match="trajectory 1 has no uncond_velocity"):
        grpo_microbatches(trajs, torch.zeros(2), text, size=3, reuse_uncond=True)


def test_microbatch_text_is_laid_out_as_the_engine_lays_it_out():
    """Real tokens only, each prompt padded to its own multiple of the engine's text_pad_multiple (the prompt and
    the negative prompt apart), a branch to its longest row, and no mask where nothing is padded (an all-True mask
    would cost a masked attention kernel the rollout did not run)."""
    import torch

    from megatron_omni.algorithms.flow_grpo.step import model_inputs
    from megatron_omni.rollout.engine import Request, Trajectory
    from megatron_omni.algorithms.flow_grpo.microbatches import grpo_microbatches

    def traj(prompt):
        req = Request(prompt=prompt, guidance_scale=3.0, img_fhw=(1, 1, 2), num_steps=2)
        return Trajectory(req, torch.randn(3, 2, 3), torch.linspace(1, 0, 3), torch.zeros(2),
                          torch.tensor([True, False]))

    def entry(n_real, n_total):  # an encoder's output: padded to n_total, mask True on the first n_real
        emb = torch.randn(n_total, 4)
        return emb, torch.arange(n_total) < n_real

    text = {"a": entry(16, 24), "b": entry(16, 16), "": entry(16, 20), "long": entry(20, 24)}
    (mb,) = grpo_microbatches([traj("a"), traj("b")], torch.zeros(2), text, size=2, text_pad_multiple=16)
    assert mb.txt.shape == (2, 16, 4) and mb.txt_mask is None and mb.uncond_mask is None
    assert torch.equal(mb.txt[0], text["a"][0][:16]) and torch.equal(mb.uncond_txt[1], text[""][0][:16])
    assert model_inputs(mb, uncond_rows=True)[4] is None  # cond + uncond rows, still unmasked
    (mb,) = grpo_microbatches([traj("long"), traj("a")], torch.zeros(2), text, size=2, text_pad_multiple=16)
    assert mb.txt.shape == (2, 32, 4) and mb.txt_mask.sum(1).tolist() == [20, 16]
    assert mb.uncond_txt.shape == (2, 16, 4) and mb.uncond_mask is None  # the negative prompt keeps its own length
    (mb,) = grpo_microbatches([traj("long")], torch.zeros(1), text, size=1)  # the engine's default: real tokens
    assert mb.txt.shape == (1, 20, 4) and mb.txt_mask is None
    assert mb.uncond_txt.shape == (1, 16, 4) and mb.uncond_mask is None


@pytest.mark.numerics
def test_check_folded_into_the_first_optimizer_step_equals_its_own_pass(tmp_path, single_rank, task, monkeypatch,
                                                                       passes):
    """When the first optimizer step trains every checked pair, the check reads that forward's log-probs (no
    forward-only pass of its own) and reports what its own pass reports: the same micro-batches at the same
    weights (here bit for bit: one kernel sequence; float32 rounding elsewhere); the training is unchanged."""
    from megatron_omni.algorithms.flow_grpo.algorithm import FlowGRPO

    calls = passes
    cfg = load_config("digits_flow_grpo", None, TINY + ["train.steps=2"])
    train(cfg, single_rank, task, tmp_path / "folded")
    assert calls == [False, False] * 2  # two optimizer steps per RL step, nothing else (the check: the first's)
    calls.clear()
    monkeypatch.setattr(FlowGRPO, "folded_check_pairs", lambda self, run, trajs: None)
    train(cfg, single_rank, task, tmp_path / "own_pass")
    assert calls == [True, False, False] * 2  # the check's forward-only pass, then the optimizer steps
    folded, own = _metrics(tmp_path / "folded"), _metrics(tmp_path / "own_pass")
    for a, b in zip(folded, own):
        assert a.keys() == b.keys() and {"logprob_abs_diff", "logprob_pearson"} <= a.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
    assert folded[0]["logprob_abs_diff"] <= 1e-6 and folded[0]["logprob_pearson"] > 0.999


def test_fp8_rollout_trains_on_the_trainers_own_old_policy(tmp_path, single_rank, task, passes):
    """``rollout.fp8``: π_old is the trainer's own recomputation at the rollout's weights -- the first optimizer step
    reads its own forward's log-probs (no extra pass), the second's are scored by one forward-only pass before any
    update.  At a learning rate too small to move a float32 weight every ratio is then exactly 1, on both paths,
    while the FP8 rollout's own log-probs, logged against the trainer's, differ from them (FP8 GEMMs in the CPU's
    float32 emulation).  Trained on the rollout's log-probs instead (``algorithm.old_log_prob=rollout``), the ratios
    are not 1; the trainer's own π_old without FP8 (``=trainer``) makes them exactly 1 too."""
    calls = passes
    cfg = load_config("digits_flow_grpo", None, TINY + ["train.steps=1", "rollout.fp8=true", "train.lr=1e-30"])
    train(cfg, single_rank, task, tmp_path / "fp8")
    assert calls == [True, False, False]  # the second optimizer step's π_old, then the two optimizer steps
    (m,) = _metrics(tmp_path / "fp8")
    assert m["ratio_mean"] == 1.0 and m["ratio_std"] == 0.0 and m["approx_kl"] == 0.0
    assert m["clipfrac_above"] == 0.0 and m["clipfrac_below"] == 0.0
    assert m["logprob_pearson"] > 0.99
    plain = load_config("digits_flow_grpo", None, TINY + ["train.steps=1", "train.lr=1e-30"])
    train(plain, single_rank, task, tmp_path / "plain")
    (p,) = _metrics(tmp_path / "plain")
    # FP8's gap, logged: well above the float32 re-scoring's (2e-6 against 1e-7 here: a 2-block model at init)
    assert m["logprob_abs_diff"] > 5 * p["logprob_abs_diff"] and m["logprob_abs_diff"] > 5e-7, (m, p)
    rollout_old = load_config("digits_flow_grpo", None, TINY + ["train.steps=1", "rollout.fp8=true", "train.lr=1e-30",
                                                                "algorithm.old_log_prob=rollout"])
    train(rollout_old, single_rank, task, tmp_path / "rollout_old")
    (r,) = _metrics(tmp_path / "rollout_old")
    assert r["ratio_std"] > 0 and r["approx_kl"] > 0
    # the trainer's own pi_old without FP8 (algorithm.old_log_prob=trainer): the float32 run's ratios exactly 1 too
    own = load_config("digits_flow_grpo", None, TINY + ["train.steps=1", "train.lr=1e-30", "algorithm.old_log_prob=trainer"])
    calls.clear()
    train(own, single_rank, task, tmp_path / "own")
    assert calls == [True, False, False]  # (the rollout's pi_old, "auto" without FP8, runs no such pass)
    (o,) = _metrics(tmp_path / "own")
    assert o["ratio_mean"] == 1.0 and o["ratio_std"] == 0.0 and o["approx_kl"] == 0.0
    assert o["logprob_abs_diff"] == p["logprob_abs_diff"]  # the same rollout, logged against the same trainer


def test_trainers_old_policy_pass_is_counted_in_the_flops(tmp_path, single_rank, task, monkeypatch):
    """With the trainer's own π_old, the forward-only pass over the second optimizer step's pairs is in the step's
    FLOPs: here (no CFG, 2 pairs per sample, 8 pairs per optimizer step) exactly a forward-only check of the last
    4 samples."""
    from megatron_omni.algorithms.flow_grpo.algorithm import FlowGRPO

    seen = []
    flops = FlowGRPO.flops

    def spy(self, run, trajs, text, check_samples=None):
        seen.append((run, trajs, text))
        return flops(self, run, trajs, text, check_samples)

    monkeypatch.setattr(FlowGRPO, "flops", spy)
    cfg = load_config("digits_flow_grpo", None, TINY + ["train.steps=1", "algorithm.old_log_prob=trainer"])
    train(cfg, single_rank, task, tmp_path / "own")
    (run, trajs, text), = seen
    algo = FlowGRPO()
    own = algo.flops(run, trajs, text)
    run.cfg.algorithm.old_log_prob = "rollout"
    plain = algo.flops(run, trajs, text)
    last4 = trajs[4:] + trajs[:4]
    check = algo.flops(run, last4, text, check_samples=4) - algo.flops(run, last4, text, check_samples=0)
    assert own - plain == pytest.approx(check, rel=1e-12) and check > 0
