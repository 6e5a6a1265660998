"""FlowGRPO (Liu et al., flow_grpo) on the Algorithm interface: SDE (or CPS / Dance) rollouts with log-probs, group
advantages, the clipped ratio loss inside megatron-core's schedule, and the true-CFG uncond reuse it owns.

The uncond reuse: with true CFG the rollout keeps its uncond outputs at the trained steps; the first optimizer
step of each RL step (and the log-prob check before it) runs while the weights are still the rollout's, so it
reads them instead of running the uncond rows (an exact saving); later optimizer steps recompute them.
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace

import torch

from megatron_omni.algorithms.advantages import GroupAdvantages, group_advantages
from megatron_omni.algorithms.base import Algorithm, RecordSpec
from megatron_omni.algorithms.ema_policy import EMAPolicy
from megatron_omni.algorithms.flow_grpo.loss import FlowGRPOLossConfig
from megatron_omni.algorithms.flow_grpo.microbatches import grpo_microbatches, without_reused_uncond
from megatron_omni.algorithms.flow_grpo.step import LOG_PROB, flow_grpo_forward_step
from megatron_omni.data.prompts import request_seed
from megatron_omni.data.text_layout import padded_length
from megatron_omni.rollout.engine import Request, Trajectory
from megatron_omni.trainer.mfu import forward_flops, lora_forward_flops, varlen_step_flops
from model_specs.common.lora import disable_adapters


class InitialWeights(EMAPolicy):
    """The policy's trained parameters as built (an average never updated), swapped in for the KL's reference pass.
    Not checkpointed: like the inline reference's frozen copy (``trainer.build.reference_policy``) they are taken
    before a checkpoint is loaded, the run config's initial weights (its seed or ``model.path``), so a run resumes at
    any layout, whichever form of the reference its checkpoint was written with."""

    def __init__(self, modules: list[torch.nn.Module]):
        super().__init__(modules, decay=0.0)

    def sharded_state_dict(self, model_sd: dict) -> dict:
        """An entry the checkpoint does not store and a load gives back as it is (megatron's LocalNonpersistentObject):
        nothing saved, and a checkpoint written without this state loads."""
        from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

        return {"initial_weights": LocalNonpersistentObject(None)}

    def load(self, loaded: dict) -> None:
        pass


class FlowGRPO(Algorithm):
    name = "flow_grpo"

    def loss_config(self, cfg) -> FlowGRPOLossConfig:
        a = cfg.algorithm
        return FlowGRPOLossConfig(clip_range=a.clip_range, kl_beta=a.kl_beta, kl_form=a.kl_form)

    def check_config(self, cfg) -> None:
        self.loss_config(cfg)  # the loss config validates its own settings

    def needs_reference(self, cfg) -> bool:
        """An inline reference forward (the KL term's reference is the initial policy): on a whole model only."""
        return cfg.algorithm.kl_beta > 0 and not self.reference_pass(cfg)

    def reference_pass(self, cfg) -> bool:
        """Whether the KL's reference means come from a forward-only pass of their own before training
        (``with_reference_means``) rather than an inline forward: under PP, where one pass of the schedule carries
        one hidden state per micro-batch between stages, so a stage's reference chunk needs a pass of its own."""
        return cfg.algorithm.kl_beta > 0 and cfg.parallel.pp > 1

    def build_state(self, cfg, policy) -> InitialWeights | None:
        """With the reference pass and full fine-tuning, the reference's weights (``InitialWeights``); else none
        (LoRA's reference is the adapters off; the inline one, build's frozen copy)."""
        if self.reference_pass(cfg) and cfg.lora.rank == 0:
            return InitialWeights(policy.modules or [policy.module])
        return None

    def reference_weights(self, run) -> ExitStack:
        """Inside: the policy's modules (every chunk) compute the initial policy (LoRA adapters off, else the initial
        weights swapped in)."""
        stack = ExitStack()
        if run.cfg.lora.rank > 0:
            for module in run.policy.modules or [run.policy.module]:
                stack.enter_context(disable_adapters(module))
        else:
            stack.enter_context(self.initial_weights(run).swapped_in())
        return stack

    def initial_weights(self, run) -> EMAPolicy:
        """Under full fine-tuning, the run's state holding the reference's weights (``build_state``'s)."""
        return run.algorithm_state

    def with_reference_means(self, run, mbs: list) -> list:
        """``mbs`` with the KL reference's step means μ_ref (``ref_mean``): one forward-only pass of the schedule
        inside ``reference_weights``, so every stage runs the reference's chunk on the reference's own hidden state.
        The reference runs its own uncond rows (a reused v_u is the rollout policy's, not the reference's)."""
        with self.reference_weights(run):
            out, _ = run.run_microbatches(without_reused_uncond(mbs), forward_only=True, collect_non_loss_data=True)
        return [replace(mb, ref_mean=o["mean"]) for mb, o in zip(mbs, out)]

    def reuses_uncond(self, cfg) -> bool:
        """Whether the rollout keeps its uncond outputs for the trainer to reuse (true CFG and the switch on)."""
        return cfg.algorithm.reuse_rollout_uncond and cfg.rollout.guidance_scale > 1

    def record_spec(self, cfg) -> RecordSpec:
        return RecordSpec(uncond_outputs=self.reuses_uncond(cfg))

    def forward_step(self, cfg, reference):
        return flow_grpo_forward_step(self.loss_config(cfg), reference=reference,
                                      reference_pass=self.reference_pass(cfg))

    def requests(self, run, step: int) -> list[Request]:
        """prompts_per_step prompts drawn for this step (seeded by it), each repeated group_size times, with the
        negative prompt of its record (else the empty one) and the fields its record brings (an edit's source
        image and text encoded with it: ``Task.inputs_for``)."""
        cfg, r = run.cfg, run.cfg.rollout
        picks = run.task.dataset().sample(step, cfg.train.seed, r.prompts_per_step)
        # Each sample draws its own SDE window from its seed.  One window shared by the whole step
        # (MixGRPO's schedule) was tried on the digits demo: the judge fell to 0.14-0.3 by step 30-40 while
        # the reward rose (reward hacking), against 0.34 -> 0.62 with per-sample windows.
        keep = self.record_spec(cfg).uncond_outputs
        schedule = None if run.task.sigmas is None else tuple(run.task.sigmas(r.num_steps).tolist())
        inputs = [run.task.inputs_for(p, p.negative_prompt or "", r.guidance_scale > 1) for p in picks]
        return [Request(prompt=p.prompt, prompt_id=k, seed=request_seed(cfg.train.seed, step, k * r.group_size + i),
                        negative_prompt=p.negative_prompt or "",
                        img_fhw=run.task.img_fhw, num_steps=r.num_steps, shift=r.shift, sigmas=schedule,
                        sampler=r.sampler,
                        noise_level=r.noise_level, log_prob_form=r.log_prob_form, window_size=r.window_size,
                        window_range=r.window_range, guidance_scale=r.guidance_scale,
                        cfg_rescale=run.family.guidance_rescale, keep_uncond_velocity=keep, **inputs[k])
                for k, p in enumerate(picks) for i in range(r.group_size)]

    def _microbatches(self, run, trajs: list[Trajectory], advantages: torch.Tensor, text) -> list:
        return grpo_microbatches(trajs, advantages, text, run.cfg.train.micro_batch_size,
                                 reuse_uncond=self.reuses_uncond(run.cfg),
                                 text_pad_multiple=run.cfg.rollout.text_pad_multiple)

    def check(self, run, trajs: list[Trajectory], text) -> dict[str, float]:
        """docs/design.md, decision 6: the trainer re-scores ``algorithm.logprob_check_samples`` trajectories'
        trained steps; mean |Δ log p| and Pearson r.  It runs before any update of this RL step, so the rollout's
        uncond outputs stand in for the uncond rows.  When the first optimizer step trains every checked pair
        (``folded_check_pairs``) its forward is that re-scoring, and ``train`` reports the check from it: {} here,
        no forward of its own."""
        if self.folded_check_pairs(run, trajs) is not None:
            return {}
        trajs = trajs[:self.check_samples(run)]
        mbs = self._microbatches(run, trajs, torch.zeros(len(trajs)), text)
        out, _ = run.run_microbatches(mbs, forward_only=True, collect_non_loss_data=True)
        return logprob_agreement(torch.cat([o[LOG_PROB] for o in out]), torch.cat([mb.old_log_prob for mb in mbs]))

    def folded_check_pairs(self, run, trajs: list[Trajectory]) -> int | None:
        """The checked (sample, step) pairs -- those of the first ``logprob_check_samples`` trajectories, the first
        pairs in training order -- when the first optimizer step trains them all (its forward runs on the
        rollout's weights); None when it does not (then ``check`` runs a forward-only pass of its own)."""
        checked = sum(int(t.trained.sum()) for t in trajs[:self.check_samples(run)])
        first_step = self.micro_batches_per_step(run) * run.cfg.train.micro_batch_size
        return checked if checked <= first_step else None

    def check_samples(self, run) -> int:
        """Trajectories this data-parallel replica checks: its share of ``algorithm.logprob_check_samples``."""
        return max(1, run.cfg.algorithm.logprob_check_samples // run.policy.state.dp)

    def micro_batches_per_step(self, run) -> int:
        """Micro-batches of one optimizer step on one data-parallel replica (``train.global_batch_size`` pairs
        over all replicas)."""
        t, dp = run.cfg.train, run.policy.state.dp
        if dp > 1 and t.global_batch_size % (t.micro_batch_size * dp):
            raise ValueError(f"train.global_batch_size={t.global_batch_size} pairs per optimizer step over {dp} "
                             f"data-parallel replicas of train.micro_batch_size={t.micro_batch_size}; expected a "
                             f"multiple of {t.micro_batch_size * dp}")
        return max(1, t.global_batch_size // (t.micro_batch_size * dp))

    def advantages(self, run, trajs: list[Trajectory], rewards) -> GroupAdvantages:
        a = run.cfg.algorithm
        return group_advantages(torch.as_tensor(rewards, dtype=torch.float32),
                                torch.tensor([t.request.prompt_id for t in trajs]), std=a.adv_std,
                                clip_max=a.adv_clip_max)

    def train(self, run, trajs: list[Trajectory], advantages: GroupAdvantages, text) -> dict[str, float]:
        """Optimizer steps over all (sample, trained step) pairs, ``train.global_batch_size`` pairs each.  Only the
        first runs with the rollout's weights: later ones recompute the uncond branch (a reused v_u there would be
        the old policy's and change the gradient)."""
        mbs = self.train_microbatches(run, trajs, advantages, text)
        if self.reference_pass(run.cfg):
            mbs = self.with_reference_means(run, mbs)
        per_opt_step = self.micro_batches_per_step(run)
        metrics, norms = [], []
        steps = self.optimizer_steps(mbs, per_opt_step)
        if self.trainer_old_policy(run.cfg):
            steps = self.recompute_old_log_probs(run, steps)
        for batch in steps:
            out, grad_norm = run.run_microbatches(batch)
            metrics += out
            norms.append(float(grad_norm))
        log_probs = [m.pop(LOG_PROB, None) for m in metrics]  # (on the last pipeline stage)
        summary = {key: torch.stack([torch.as_tensor(m[key]).float() for m in metrics]).mean().item()
                   for key in metrics[0]}
        summary.update(grad_norm=sum(norms) / len(norms), optimizer_steps=len(norms),
                       zero_std_ratio=advantages.zero_std_ratio)
        checked = self.folded_check_pairs(run, trajs)
        if checked is not None:  # the first optimizer step's log-probs are the rollout weights' (check)
            if any(lp is None for lp in log_probs):
                raise ValueError(f"{self.name}: the training micro-batches' metrics lack {LOG_PROB!r}, which the "
                                 f"folded log-prob check reads; expected a forward step from flow_grpo_forward_step")
            summary.update(logprob_agreement(torch.cat(log_probs)[:checked],
                                             torch.cat([mb.old_log_prob for mb in mbs])[:checked]))
        return summary

    def trainer_old_policy(self, cfg) -> bool:
        """Whether π_old is the trainer's recomputation rather than the rollout's log-probs
        (``algorithm.old_log_prob``; "auto": when the rollout samples with other GEMMs than the trainer, an FP8
        rollout or LoRA adapters merged into its weights, so that its log-probs are logged against the trainer's,
        the check, and not trained on)."""
        source = cfg.algorithm.old_log_prob
        if source != "auto":
            return source == "trainer"
        return bool(cfg.rollout.fp8) or cfg.rollout_merges_lora

    def recompute_old_log_probs(self, run, steps: list[list]) -> list[list]:
        """The optimizer steps with π_old from the trainer at the rollout's weights: the first step's micro-batches
        take their own forward's log-prob (``old_from_forward``: no extra pass, first ratio exactly 1); a later
        step's are scored by a forward-only pass before any update, with the uncond rows that step runs itself."""
        later = [mb for batch in steps[1:] for mb in batch]
        scored = iter([])
        if later:
            out, _ = run.run_microbatches(later, forward_only=True, collect_non_loss_data=True)
            scored = iter([o[LOG_PROB] for o in out])
        return [[replace(mb, old_from_forward=True) for mb in steps[0]]] + [
            [replace(mb, old_log_prob=next(scored).to(mb.old_log_prob.device)) for mb in batch] for batch in steps[1:]]

    def train_microbatches(self, run, trajs: list[Trajectory], advantages: GroupAdvantages, text) -> list:
        """The micro-batches ``train`` runs (a subclass adds what its loss needs, e.g. the old policy's means)."""
        return self._microbatches(run, trajs, advantages.advantages, text)

    def optimizer_steps(self, mbs: list, per_opt_step: int) -> list[list]:
        """The micro-batches of each optimizer step.  Only the first runs with the weights the rollout used: later
        ones recompute the uncond branch (a reused v_u there would be the old policy's and change the gradient)."""
        steps = [mbs[k:k + per_opt_step] for k in range(0, len(mbs), per_opt_step)]
        return steps[:1] + [without_reused_uncond(s) for s in steps[1:]]

    def flops(self, run, trajs: list[Trajectory], text, check_samples: int | None = None) -> float:
        """The step's DiT FLOPs: the forwards actually run, each row at the image tokens (its grid and an edit's
        context) and text length it ran at (``text``: prompt -> (embedding, mask), laid out as the engine lays it
        out; a request's own embeddings where it carries them); no uncond rows where the rollout's uncond output
        was reused; with LoRA, no weight gradients of the frozen base and the adapters' own FLOPs; with the trainer's
        own π_old, the forward-only pass over the pairs after the first optimizer step.
        ``check_samples``: the samples a forward-only check scores (default: ``algorithm.logprob_check_samples``,
        none when the check is folded into the first optimizer step)."""
        cfg = run.cfg
        arch, lengths = cfg.model.arch, {}

        def length(prompt: str, emb, mask) -> int:
            if emb is not None:  # the request's own embeddings (an edit's)
                return padded_length([emb.shape[0] if mask is None else int(mask.sum())], cfg.rollout.text_pad_multiple)
            if prompt not in lengths:
                lengths[prompt] = length(prompt, *text[prompt][:2])
            return lengths[prompt]

        def row(t: Trajectory, negative: bool) -> tuple[int, int]:
            """(image tokens, text tokens) of one of the trajectory's rows: its grid plus its context tokens."""
            q = t.request
            image = q.img_fhw[0] * q.img_fhw[1] * q.img_fhw[2]
            image += 0 if q.context_latents is None else q.context_latents.shape[0]
            if negative:
                return image, length(q.negative_prompt, q.negative_prompt_emb, q.negative_prompt_mask)
            return image, length(q.prompt, q.prompt_emb, q.prompt_mask)

        def per_row(key: tuple[int, int]) -> tuple[float, float]:
            image_tokens, n = key
            return (forward_flops(arch, 1, image_tokens, n),
                    lora_forward_flops(arch, cfg.lora.rank, cfg.lora_targets, 1, image_tokens, n))

        with_cfg, reuse = cfg.rollout.guidance_scale > 1, self.reuses_uncond(cfg)
        samples = [(row(t, False), row(t, True) if with_cfg else None, int(t.trained.sum())) for t in trajs]
        pairs = sum(n for _, _, n in samples)
        reused = min(pairs, self.micro_batches_per_step(run) * cfg.train.micro_batch_size) if reuse else 0
        if check_samples is None:  # a check folded into the first optimizer step runs no forward of its own
            check_samples = 0 if self.folded_check_pairs(run, trajs) is not None else self.check_samples(run)
        total = varlen_step_flops(per_row, samples, rollout_steps=cfg.rollout.num_steps, frozen_base=cfg.lora.rank > 0,
                                  reused_uncond_pairs=reused, check_samples=check_samples,
                                  check_reuses_uncond=reuse, kl=cfg.algorithm.kl_beta > 0,
                                  merged_rollout=cfg.rollout_merges_lora)
        if self.trainer_old_policy(cfg):  # pi_old of the pairs after the first optimizer step: a forward-only pass
            skip = self.micro_batches_per_step(run) * cfg.train.micro_batch_size
            for cond, uncond, n in samples:
                later, skip = max(0, n - max(0, skip)), skip - n
                rows = [cond] + ([uncond] if uncond is not None else [])  # (that pass runs its uncond rows itself)
                total += later * sum(sum(per_row(key)) for key in rows)
        return total


def logprob_agreement(trainer_lp: torch.Tensor, rollout_lp: torch.Tensor) -> dict[str, float]:
    """Mean |Δ log p| and Pearson r of the trainer's log-probs against the rollout's, per (sample, step) pair."""
    trainer_lp, rollout_lp = trainer_lp.detach().float().cpu(), rollout_lp.detach().float().cpu()
    pearson = torch.corrcoef(torch.stack([trainer_lp, rollout_lp]))[0, 1].item() if len(trainer_lp) > 1 else 1.0
    return {"logprob_abs_diff": (trainer_lp - rollout_lp).abs().mean().item(), "logprob_pearson": pearson}


ALGORITHM = FlowGRPO()
