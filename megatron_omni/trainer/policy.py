"""The trained model as megatron-core wants it: DDP-wrapped chunks, its optimizer, and one call that
runs a list of micro-batches through ``forward_backward_func`` and steps the optimizer.

Under pipeline parallelism a rank holds ``vpp or 1`` model chunks (virtual stages, megatron's chunk
order: ``megatron_omni.parallel.pipeline.stage_layers``); under context parallelism every chunk splits
the image tokens over the CP group with USP attention (``state.cp_groups``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from model_specs.common.recompute import apply_recompute, recompute_config
from model_specs.family import family_of
from megatron_omni.compile import compile_blocks
from megatron_omni.parallel.cpu_compat import cuda_factories_on_cpu
from megatron_omni.parallel.mcore_fallbacks import use_fast_fallbacks
from megatron_omni.parallel.pipeline import stage_layers
from megatron_omni.parallel.state import ParallelState
from megatron_omni.trainer.grad_flush import GradFlush, batchable, mark_for_flush, worth_batching


@dataclass
class Policy:
    module: torch.nn.Module  # the bare model of the first chunk (rollout export, LoRA, reference passes)
    model: DistributedDataParallel  # the first chunk as the schedule runs it
    optimizer: Any  # megatron-core MegatronOptimizer
    state: ParallelState
    modules: list[torch.nn.Module] = field(default_factory=list)  # every chunk of this rank, in order
    models: list[DistributedDataParallel] = field(default_factory=list)
    grad_flush: GradFlush | None = None  # the adds into main_grad, batched (megatron_omni.trainer.grad_flush)

    @property
    def is_last_stage(self) -> bool:
        return self.state.pp_rank == self.state.pp - 1


def policy_transformer_config(arch, state: ParallelState, dtype: torch.dtype, recompute: str = "none",
                              recompute_num_layers: int = 1):
    """The TransformerConfig of a policy at ``state``'s TP x CP x PP (x VPP) layout; ``recompute``: megatron's
    activation recompute (none | full | selective: ``model_specs.common.recompute``)."""
    config = family_of(arch).transformer_config(
        arch, state.tp, params_dtype=dtype, context_parallel_size=state.cp, pipeline_model_parallel_size=state.pp,
        virtual_pipeline_model_parallel_size=state.vpp, pipeline_dtype=dtype,
        # stage boundaries carry [S_T + S_I/cp, B, H] with S_T and B varying (CFG doubles B), so shapes
        # travel with the tensors; megatron-core 0.19.2 wants the alltoall dispatcher for that, MoE or not
        variable_seq_lengths=state.pp > 1, moe_token_dispatcher_type="alltoall",
        # gloo pairs the sends and receives of one batch_isend_irecv by order, not by peer and role: in
        # interleaved 1F1B a stage then reads another message (measured: zeros / the wrong chunk's input)
        batch_p2p_comm=state.device.backend != "gloo", **recompute_config(recompute, recompute_num_layers))
    config.has_cond_embedder = True  # finalize_model_grads sums the `pipeline_parallel` params over PP
    config.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=state.pg_collection)
    return config


def build_chunks(arch, state: ParallelState, config, backend: str = "local",
                 layout: Sequence[int] | None = None) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual stage) of ``arch``'s family, blocks named by global index."""
    vpp, family = state.vpp or 1, family_of(arch)
    return [family.build(arch, config, state.tp_group, backend, cp_groups=state.cp_groups,
                         pre_process=state.pp_rank == 0 and v == 0,
                         post_process=state.pp_rank == state.pp - 1 and v == vpp - 1,
                         layers=stage_layers(family.num_blocks(arch), state.pp, state.pp_rank, state.vpp, v, layout))
            for v in range(vpp)]


def build_policy(arch, state: ParallelState, *, lr: float, weight_decay: float = 0.0,
                 clip_grad: float = 1.0, dtype: torch.dtype = torch.float32, backend: str = "local",
                 prepare: Callable[[torch.nn.Module], None] | None = None,
                 layout: Sequence[int] | None = None, batched_grads: bool | None = None,
                 recompute: str = "none", recompute_num_layers: int = 1) -> Policy:
    """``prepare(module)`` runs on every chunk before DDP wraps it: load weights, attach LoRA, freeze
    params.  ``layout``: blocks per pipeline chunk (default: an even split).  ``batched_grads``: accumulate the
    gradients into DDP's main_grad with a few batched adds per micro-batch where the layout allows
    (``megatron_omni.trainer.grad_flush``; bit-identical to megatron's per-parameter hooks, which run otherwise);
    None: when few parameters train (``grad_flush.worth_batching``: LoRA), since each micro-batch's gradients then
    stay alive until its flush (+2 bytes per trained bf16 parameter at the end of a backward: nothing for LoRA,
    ~11 % more memory for full fine-tuning with Adam).  ``recompute`` / ``recompute_num_layers``: activation recompute
    in the training forward (``model_specs.common.recompute``; none | full | selective).
    Train through ``run_microbatches`` (megatron's schedule); a hand-written backward must call
    ``policy.grad_flush.flush()`` before the optimizer step, or its gradients never reach main_grad."""
    config = policy_transformer_config(arch, state, dtype, recompute, recompute_num_layers)
    modules = [m.to(state.torch_device) for m in build_chunks(arch, state, config, backend, layout)]
    for module in modules:
        apply_recompute(module, config)
        if prepare is not None:
            prepare(module)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    wanted = worth_batching(modules[0]) if batched_grads is None else batched_grads
    batched = wanted and batchable(state.pp, len(modules), ddp_config.overlap_grad_reduce)
    ddp_config.delay_wgrad_compute = batched  # megatron's switch: marked params get no per-parameter hook
    ddps, flushed = [], None
    for i, module in enumerate(modules):
        flushed = mark_for_flush(module) if batched else None
        ddps.append(DistributedDataParallel(config, ddp_config, module, pg_collection=state.pg_collection,
                                            disable_bucketing=i > 0))
    grad_flush = None
    if batched:
        grad_flush = GradFlush(flushed)
        grad_flush.install(modules[0], config)
    use_fast_fallbacks()  # the grad-norm fallback without apex / TE syncs per tensor
    opt_config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                                 bf16=dtype == torch.bfloat16, params_dtype=dtype, adam_beta1=0.9, adam_beta2=0.999)
    with cuda_factories_on_cpu():
        optimizer = get_megatron_optimizer(opt_config, ddps, pg_collection=state.pg_collection,
                                           use_gloo_process_groups=False)
    return Policy(module=modules[0], model=ddps[0], optimizer=optimizer, state=state, modules=modules, models=ddps,
                  grad_flush=grad_flush)


def compile_policy(policy: Policy, mode: str, blocks_per_graph: int | None = None) -> None:
    """Every block of every chunk of this rank under torch.compile (``megatron_omni.compile``; ``blocks_per_graph``
    None: its default); DDP's grad hooks sit on the parameters, outside the compiled graphs, so they fire as in
    eager mode."""
    for module in policy.modules or [policy.module]:
        compile_blocks(module, mode, blocks_per_graph)


def run_microbatches(policy: Policy, forward_step_func, microbatches: list, forward_only: bool = False,
                     collect_non_loss_data: bool = False, boundary_shape: tuple[int, int] | None = None):
    """One pass of megatron-core's schedule over ``microbatches`` (no pipelining, 1F1B, or interleaved
    1F1B when the state has vpp), then the optimizer step unless ``forward_only``.

    Returns (per-micro-batch metric dicts, grad norm or None).  Metrics exist on the last pipeline stage
    only (other stages get []; ``megatron_omni.parallel.pipeline.broadcast_from_last_stage`` shares
    them).  Gradients are the mean over micro-batches: the schedule divides each returned loss by their
    number.  ``collect_non_loss_data`` (forward only) returns what ``loss_func(output, non_loss_data=True)``
    gives, per micro-batch.  Every pipeline rank passes the same micro-batches: non-first stages read
    only the conditioning (timesteps, text length and mask) from them.

    ``boundary_shape`` = (S_T + S_I, rows per forward) when every micro-batch has that stage-boundary
    shape: the schedule then sends tensors of a fixed shape; None exchanges shapes per message
    (``variable_seq_lengths``, not with the interleaved schedule).
    """
    models = policy.models or [policy.model]
    config = policy.module.config
    if policy.state.pp > 1:
        config.variable_seq_lengths = boundary_shape is None
    if len(models) > 1 and boundary_shape is None:
        raise ValueError(f"interleaved pipeline (vpp={len(models)}) needs micro-batches of one stage-boundary shape "
                         f"(megatron-core 0.19.2 exchanges shapes per message only without interleaving): pass "
                         f"boundary_shape=(text + image tokens, rows per forward)")
    seq_length, micro_batch_size = boundary_shape or (1, 1)
    if not forward_only:
        for model in models:
            model.zero_grad_buffer()
        policy.optimizer.zero_grad()
    data = [iter(microbatches) for _ in models] if len(models) > 1 else iter(microbatches)
    with cuda_factories_on_cpu():
        metrics = get_forward_backward_func()(
            forward_step_func=forward_step_func, data_iterator=data, model=models,
            num_microbatches=len(microbatches), seq_length=seq_length, micro_batch_size=micro_batch_size,
            forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data)
        grad_norm = None
        if not forward_only:
            _, grad_norm, _ = policy.optimizer.step()
    return metrics, grad_norm
