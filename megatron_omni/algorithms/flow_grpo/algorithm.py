"""FlowGRPO (Liu et al., flow_grpo) on the Algorithm interface: SDE (or CPS / Dance) rollouts with log-probs, group
advantages, the clipped ratio loss inside megatron-core's schedule, and the true-CFG uncond reuse it owns.

The uncond reuse: with true CFG the rollout keeps its uncond outputs at the trained steps; the first optimizer
step of each RL step (and the log-prob check before it) runs while the weights are still the rollout's, so it
reads them instead of running the uncond rows (an exact saving); later optimizer steps recompute them.
"""
from __future__ import annotations

import torch

from megatron_omni.algorithms.advantages import GroupAdvantages, group_advantages
from megatron_omni.algorithms.base import Algorithm, RecordSpec
from megatron_omni.algorithms.flow_grpo.loss import FlowGRPOLossConfig
from megatron_omni.algorithms.flow_grpo.microbatches import grpo_microbatches, without_reused_uncond
from megatron_omni.algorithms.flow_grpo.step import flow_grpo_forward_step
from megatron_omni.data.prompts import PromptDataset, request_seed
from megatron_omni.data.text_layout import padded_length
from megatron_omni.rollout.engine import Request, Trajectory
from megatron_omni.trainer.mfu import forward_flops, lora_forward_flops, varlen_step_flops


class FlowGRPO(Algorithm):
    name = "flow_grpo"

    def loss_config(self, cfg) -> FlowGRPOLossConfig:
        a = cfg.algorithm
        return FlowGRPOLossConfig(clip_range=a.clip_range, kl_beta=a.kl_beta, kl_form=a.kl_form)

    def check_config(self, cfg) -> None:
        self.loss_config(cfg)  # the loss config validates its own settings

    def needs_reference(self, cfg) -> bool:
        return cfg.algorithm.kl_beta > 0  # the KL term's reference is the initial policy

    def reuses_uncond(self, cfg) -> bool:
        """Whether the rollout keeps its uncond outputs for the trainer to reuse (true CFG and the switch on)."""
        return cfg.algorithm.reuse_rollout_uncond and cfg.rollout.guidance_scale > 1

    def record_spec(self, cfg) -> RecordSpec:
        return RecordSpec(uncond_outputs=self.reuses_uncond(cfg))

    def forward_step(self, cfg, reference):
        return flow_grpo_forward_step(self.loss_config(cfg), reference=reference)

    def requests(self, run, step: int) -> list[Request]:
        """prompts_per_step prompts drawn for this step (seeded by it), each repeated group_size times."""
        cfg, r = run.cfg, run.cfg.rollout
        picks = PromptDataset.from_prompts(run.task.prompts).sample(step, cfg.train.seed, r.prompts_per_step)
        # Each sample draws its own SDE window from its seed.  One window shared by the whole step
        # (MixGRPO's schedule) was tried on the digits demo: the judge fell to 0.14-0.3 by step 30-40 while
        # the reward rose (reward hacking), against 0.34 -> 0.62 with per-sample windows.
        keep = self.record_spec(cfg).uncond_outputs
        schedule = None if run.task.sigmas is None else tuple(run.task.sigmas(r.num_steps).tolist())
        return [Request(prompt=p.prompt, prompt_id=k, seed=request_seed(cfg.train.seed, step, k * r.group_size + i),
                        img_fhw=run.task.img_fhw, num_steps=r.num_steps, shift=r.shift, sigmas=schedule,
                        sampler=r.sampler,
                        noise_level=r.noise_level, log_prob_form=r.log_prob_form, window_size=r.window_size,
                        window_range=r.window_range, guidance_scale=r.guidance_scale,
                        cfg_rescale=run.family.guidance_rescale, keep_uncond_velocity=keep)
                for k, p in enumerate(picks) for i in range(r.group_size)]

    def _microbatches(self, run, trajs: list[Trajectory], advantages: torch.Tensor, text) -> list:
        return grpo_microbatches(trajs, advantages, text, run.cfg.train.micro_batch_size,
                                 reuse_uncond=self.reuses_uncond(run.cfg),
                                 text_pad_multiple=run.cfg.rollout.text_pad_multiple)

    def check(self, run, trajs: list[Trajectory], text) -> dict[str, float]:
        """docs/design.md, decision 6: the trainer re-scores ``algorithm.logprob_check_samples`` trajectories'
        trained steps; mean |Δ log p| and Pearson r.  It runs before any update of this RL step, so the rollout's
        uncond outputs stand in for the uncond rows."""
        trajs = trajs[:run.cfg.algorithm.logprob_check_samples]
        mbs = self._microbatches(run, trajs, torch.zeros(len(trajs)), text)
        out, _ = run.run_microbatches(mbs, forward_only=True, collect_non_loss_data=True)
        trainer_lp = torch.cat([o["log_prob"] for o in out]).cpu()
        rollout_lp = torch.cat([mb.old_log_prob for mb in mbs]).cpu()
        pearson = torch.corrcoef(torch.stack([trainer_lp, rollout_lp]))[0, 1].item() if len(trainer_lp) > 1 else 1.0
        return {"logprob_abs_diff": (trainer_lp - rollout_lp).abs().mean().item(), "logprob_pearson": pearson}

    def advantages(self, run, trajs: list[Trajectory], rewards) -> GroupAdvantages:
        a = run.cfg.algorithm
        return group_advantages(torch.as_tensor(rewards, dtype=torch.float32),
                                torch.tensor([t.request.prompt_id for t in trajs]), std=a.adv_std,
                                clip_max=a.adv_clip_max)

    def train(self, run, trajs: list[Trajectory], advantages: GroupAdvantages, text) -> dict[str, float]:
        """Optimizer steps over all (sample, trained step) pairs, ``train.global_batch_size`` pairs each.  Only the
        first runs with the rollout's weights: later ones recompute the uncond branch (a reused v_u there would be
        the old policy's and change the gradient)."""
        mbs = self._microbatches(run, trajs, advantages.advantages, text)
        per_opt_step = max(1, run.cfg.train.global_batch_size // run.cfg.train.micro_batch_size)
        metrics, norms = [], []
        for batch in self.optimizer_steps(mbs, per_opt_step):
            out, grad_norm = run.run_microbatches(batch)
            metrics += out
            norms.append(float(grad_norm))
        summary = {key: torch.stack([torch.as_tensor(m[key]).float() for m in metrics]).mean().item()
                   for key in metrics[0]}
        summary.update(grad_norm=sum(norms) / len(norms), optimizer_steps=len(norms),
                       zero_std_ratio=advantages.zero_std_ratio)
        return summary

    def optimizer_steps(self, mbs: list, per_opt_step: int) -> list[list]:
        """The micro-batches of each optimizer step.  Only the first runs with the weights the rollout used: later
        ones recompute the uncond branch (a reused v_u there would be the old policy's and change the gradient)."""
        steps = [mbs[k:k + per_opt_step] for k in range(0, len(mbs), per_opt_step)]
        return steps[:1] + [without_reused_uncond(s) for s in steps[1:]]

    def flops(self, run, trajs: list[Trajectory], text) -> float:
        """The step's DiT FLOPs: the forwards actually run, each row at the text length it ran at (``text``: prompt
        -> (embedding, mask), laid out as the engine lays it out); no uncond rows where the rollout's uncond output
        was reused; with LoRA, no weight gradients of the frozen base and the adapters' own FLOPs."""
        cfg = run.cfg
        arch, fhw = cfg.model.arch, run.task.img_fhw
        image_tokens, lengths = fhw[0] * fhw[1] * fhw[2], {}

        def length(prompt: str) -> int:
            if prompt not in lengths:
                emb, mask = text[prompt]
                lengths[prompt] = padded_length([emb.shape[0] if mask is None else int(mask.sum())],
                                                cfg.rollout.text_pad_multiple)
            return lengths[prompt]

        def per_row(n: int) -> tuple[float, float]:
            return (forward_flops(arch, 1, image_tokens, n),
                    lora_forward_flops(arch, cfg.lora.rank, cfg.lora_targets, 1, image_tokens, n))

        with_cfg, reuse = cfg.rollout.guidance_scale > 1, self.reuses_uncond(cfg)
        samples = [(length(t.request.prompt), length(t.request.negative_prompt) if with_cfg else None,
                    int(t.trained.sum())) for t in trajs]
        pairs = sum(n for _, _, n in samples)
        reused = min(pairs, max(cfg.train.global_batch_size, cfg.train.micro_batch_size)) if reuse else 0
        return varlen_step_flops(per_row, samples, rollout_steps=cfg.rollout.num_steps, frozen_base=cfg.lora.rank > 0,
                                 reused_uncond_pairs=reused, check_samples=cfg.algorithm.logprob_check_samples,
                                 check_reuses_uncond=reuse, kl=cfg.algorithm.kl_beta > 0)


ALGORITHM = FlowGRPO()
