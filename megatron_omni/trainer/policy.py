"""The trained model as megatron-core wants it: DDP-wrapped chunks, its optimizer, and one call that
runs a list of micro-batches through ``forward_backward_func`` and steps the optimizer."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from model_specs.qwen_image.config import QwenImageConfig
from model_specs.qwen_image.model import QwenImageModel
from model_specs.qwen_image.spec import qwen_image_block_spec
from megatron_omni.parallel.cpu_compat import cuda_factories_on_cpu
from megatron_omni.parallel.state import ParallelState


@dataclass
class Policy:
    module: QwenImageModel  # the bare model (rollout export, LoRA, reference passes)
    model: DistributedDataParallel  # what the schedule runs
    optimizer: Any  # megatron-core MegatronOptimizer
    state: ParallelState


def build_policy(arch: QwenImageConfig, state: ParallelState, *, lr: float, weight_decay: float = 0.0,
                 clip_grad: float = 1.0, dtype: torch.dtype = torch.float32, backend: str = "local",
                 prepare: Callable[[QwenImageModel], None] | None = None) -> Policy:
    """``prepare(module)`` runs before DDP wraps the model: load weights, attach LoRA, freeze params."""
    config = arch.transformer_config(state.tp, params_dtype=dtype)
    config.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=state.pg_collection)
    module = QwenImageModel(arch, config, state.tp_group, qwen_image_block_spec(backend)).to(state.torch_device)
    if prepare is not None:
        prepare(module)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module,
                                  pg_collection=state.pg_collection)
    opt_config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                                 bf16=dtype == torch.bfloat16, params_dtype=dtype, adam_beta1=0.9, adam_beta2=0.999)
    with cuda_factories_on_cpu():
        optimizer = get_megatron_optimizer(opt_config, [ddp], pg_collection=state.pg_collection,
                                           use_gloo_process_groups=False)
    return Policy(module=module, model=ddp, optimizer=optimizer, state=state)


def run_microbatches(policy: Policy, forward_step_func, microbatches: list, forward_only: bool = False,
                     collect_non_loss_data: bool = False):
    """One pass of megatron-core's schedule over ``microbatches`` (PP=1 here, any schedule later).

    Returns (per-micro-batch metric dicts, grad norm or None).  Gradients are the mean over
    micro-batches: the schedule divides each returned loss by their number.  ``collect_non_loss_data``
    (forward only) returns what ``loss_func(output, non_loss_data=True)`` gives, per micro-batch.
    """
    if not forward_only:
        policy.model.zero_grad_buffer()
        policy.optimizer.zero_grad()
    with cuda_factories_on_cpu():
        metrics = get_forward_backward_func()(
            forward_step_func=forward_step_func, data_iterator=iter(microbatches), model=[policy.model],
            num_microbatches=len(microbatches), seq_length=1, micro_batch_size=1, forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data)
        grad_norm = None
        if not forward_only:
            _, grad_norm, _ = policy.optimizer.step()
    return metrics, grad_norm
