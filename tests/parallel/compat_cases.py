"""The rank side of test_cpu_compat.py: megatron-core calls run with and without each CPU patch.

``compat_cases`` runs in every rank of one 2-rank gloo launch: first at TP=2, then TP=1 × DP=2 on the
same ranks.  Each case returns plain numbers and error texts; the assertions live in the test module.
"""
import contextlib
import copy
import logging
import os
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_omni.parallel import apply_cpu_compat, cuda_factories_on_cpu, destroy_parallel, init_parallel

PATCHED_CUDA_FUNCTIONS = ("current_device", "synchronize", "current_stream", "get_rng_state", "manual_seed")


# --- helpers ----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _unpatched(owner, name, original):
    """Put the original function back for the duration of one call."""
    patched = getattr(owner, name)
    setattr(owner, name, original)
    try:
        yield
    finally:
        setattr(owner, name, patched)


def _error(call):
    """None if ``call()`` succeeds, else the exception and the megatron-core line that raised it."""
    try:
        call()
    except Exception as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/megatron/core/" in f.filename]
        site = f"{frames[-1].filename.split('/megatron/core/')[1]}:{frames[-1].lineno}" if frames else None
        return {"error": f"{type(exc).__name__}: {exc}", "site": site}
    return None


def _gather(tensor, group):
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts)


def _column_linear(state, init_method=torch.nn.init.normal_, gather_output=False):
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    layer = ColumnParallelLinear(
        8, 6, config=ModelParallelConfig(tensor_model_parallel_size=state.tp), init_method=init_method,
        bias=True, gather_output=gather_output, tp_group=state.tp_group,
    )
    with torch.no_grad():
        layer.bias.copy_(torch.arange(layer.bias.numel()) + 10.0 * state.tp_rank)
    return layer


def _tiny_model():
    """A one-Linear MegatronModule, enough for DDP, the schedules and the optimizer."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer import MegatronModule, TransformerConfig

    class Tiny(MegatronModule):
        model_type = ModelType.encoder_or_decoder

        def __init__(self):
            super().__init__(TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1))
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

        def set_input_tensor(self, tensor):
            """Only called between pipeline stages; these tests run PP=1."""

    return Tiny()


def _max_diff(a, b):
    return (a - b).abs().max().item()


# --- cases at TP=2 ----------------------------------------------------------------------------------------

def _column_parallel_gather_output(state, originals):
    """torch.cuda.current_device → CPU: ColumnParallelLinear(gather_output=True) allocates the gather
    buffer with device=torch.cuda.current_device() (tensor_parallel/mappings.py)."""
    layer = _column_linear(state, gather_output=True)
    torch.manual_seed(0)
    x_SBH, w_SBO = torch.randn(5, 3, 8, requires_grad=True), torch.randn(5, 3, 6)
    with _unpatched(torch.cuda, "current_device", originals["current_device"]):
        without = _error(lambda: layer(x_SBH))
    y_SBO, _ = layer(x_SBH)
    (y_SBO * w_SBO).sum().backward()

    full_w = _gather(layer.weight, state.tp_group).requires_grad_()
    full_b = _gather(layer.bias, state.tp_group)
    ref_x = x_SBH.detach().clone().requires_grad_()
    ref_y = F.linear(ref_x, full_w, full_b)
    (ref_y * w_SBO).sum().backward()
    rows = slice(6 // state.tp * state.tp_rank, 6 // state.tp * (state.tp_rank + 1))
    return {
        "without": without,
        "out_diff": _max_diff(y_SBO, ref_y),
        "dgrad_diff": _max_diff(x_SBH.grad, ref_x.grad),
        "wgrad_diff": _max_diff(layer.weight.grad, full_w.grad[rows]),
    }


def _rng_draws():
    """(default stream before, forked, default stream after) after seeding megatron's tracker with 5."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(5)
    before = torch.randn(4)
    with get_cuda_rng_tracker().fork():
        forked = torch.randn(4)
    after = torch.randn(4)
    torch.manual_seed(5)
    return {"forked": forked.tolist(), "default_stream_kept": torch.equal(torch.cat([before, after]), torch.randn(8))}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _fork_warnings():
    """Messages megatron logs around a fork in which a random op runs (as in weight init or dropout)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.tensor_parallel import random as megatron_random

    records = _Records()
    logger = logging.getLogger(megatron_random.__name__)
    logger.addHandler(records)
    with get_cuda_rng_tracker().fork():
        torch.randn(2)
    logger.removeHandler(records)
    return records.messages


def _rng_routed_to_cpu(state, originals):
    """torch.cuda.get_rng_state / manual_seed and megatron's _set_cuda_rng_state drive the CPU generator."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.tensor_parallel import random as megatron_random

    result = {"first": _rng_draws(), "again": _rng_draws()}
    with _unpatched(torch.cuda, "get_rng_state", originals["get_rng_state"]):
        result["without_get_rng_state"] = _error(lambda: model_parallel_cuda_manual_seed(5))
    with _unpatched(megatron_random, "_set_cuda_rng_state", originals["_set_cuda_rng_state"]):
        result["without_set_rng_state"] = _rng_draws()
    torch.manual_seed(0)
    with _unpatched(torch.cuda, "manual_seed", originals["manual_seed"]):
        result["without_manual_seed"] = _rng_draws()

    model_parallel_cuda_manual_seed(5)
    result["fork_warnings"] = _fork_warnings()
    logger = logging.getLogger(megatron_random.__name__)
    filters, logger.filters = logger.filters, []
    result["fork_warnings_without_filter"] = _fork_warnings()
    logger.filters = filters
    return result


def _checkpoint_save(state, originals, ckpt_dir):
    """torch.cuda.synchronize → no-op and current_device → CPU: dist_checkpointing.save reaches both
    (filesystem_async.py preload, state_dict_saver.py finalize)."""
    from megatron.core import dist_checkpointing

    layer = _column_linear(state)
    metadata = {"dp_cp_group": state.pg_collection.dp_cp}
    result = {}
    for name in ("synchronize", "current_device"):
        path = os.path.join(ckpt_dir, f"without_{name}")
        os.makedirs(path, exist_ok=True)
        dist.barrier()
        with _unpatched(torch.cuda, name, originals[name]):
            result[f"without_{name}"] = _error(lambda: dist_checkpointing.save(
                layer.sharded_state_dict(prefix="lin.", metadata=metadata), path))
    path = os.path.join(ckpt_dir, "tp2")
    os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(layer.sharded_state_dict(prefix="lin.", metadata=metadata), path)
    result["full"] = (_gather(layer.weight, state.tp_group), _gather(layer.bias, state.tp_group))
    return result


# --- cases at TP=1, DP=2 ----------------------------------------------------------------------------------

def _checkpoint_load_at_tp1(state, ckpt_dir, full):
    from megatron.core import dist_checkpointing

    layer = _column_linear(state, init_method=torch.nn.init.zeros_)
    metadata = {"dp_cp_group": state.pg_collection.dp_cp}
    loaded = dist_checkpointing.load(layer.sharded_state_dict(prefix="lin.", metadata=metadata),
                                     os.path.join(ckpt_dir, "tp2"))
    layer.load_state_dict({key.removeprefix("lin."): value for key, value in loaded.items()})
    return {"weight_equal": torch.equal(layer.weight, full[0]), "bias_equal": torch.equal(layer.bias, full[1])}


def _ddp_finish_grad_sync(state, originals):
    """torch.cuda.current_stream → torch.cpu's stream: DDP's grad sync waits on it
    (distributed/param_and_grad_buffer.py)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model = _tiny_model()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model,
                                  pg_collection=state.pg_collection)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(state.dp_rank))  # different data per rank
    ddp(x).pow(2).sum().backward()
    with _unpatched(torch.cuda, "current_stream", originals["current_stream"]):
        without = _error(ddp.finish_grad_sync)
    ddp.finish_grad_sync()

    reference(x).pow(2).sum().backward()
    diffs = []
    for param, ref in zip(model.parameters(), reference.parameters()):
        dist.all_reduce(ref.grad, group=state.dp_group)
        diffs.append(_max_diff(param.main_grad, ref.grad / state.dp))
    return {"without": without, "main_grad_vs_mean_grad": max(diffs)}


def _schedule_with_custom_loss(state):
    """cuda_factories_on_cpu: every schedule makes torch.zeros(..., device="cuda") (schedules.py:749)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = _tiny_model()
    reference = copy.deepcopy(model)
    batches = [torch.randn(2, 4) for _ in range(3)]

    def forward_step(data_iterator, chunk):
        def loss_func(y):
            loss = y.pow(2).mean()
            # The schedule scales the returned loss IN PLACE (schedules.py:340-341): a metric that is a
            # detached view of it gets scaled too, a clone keeps the value the loss had.
            return loss, {"loss": loss.detach().clone(), "view": loss.detach()}
        return chunk(next(data_iterator)), loss_func

    def run():
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=2, micro_batch_size=2,
        )

    without = _error(run)
    with cuda_factories_on_cpu():
        metrics = run()
    ref_losses = [reference(x).pow(2).mean() for x in batches]
    (sum(ref_losses) / len(batches)).backward()  # the schedule scales each micro-batch loss by 1/num_microbatches
    return {
        "without": without,
        "losses": [m["loss"].item() for m in metrics],
        "views": [m["view"].item() for m in metrics],
        "ref_losses": [loss.item() for loss in ref_losses],
        "grad_diff": max(_max_diff(p.grad, r.grad) for p, r in zip(model.parameters(), reference.parameters())),
    }


def _distributed_optimizer_steps(state):
    """cuda_factories_on_cpu around get_megatron_optimizer and step(): hard-coded device='cuda' tensors
    and the Tensor.type() == 'torch.cuda.FloatTensor' checks (distrib_optimizer.py, clip_grads.py)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = _tiny_model()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                  model, pg_collection=state.pg_collection)
    config = OptimizerConfig(optimizer="adam", lr=0.1, weight_decay=0.0, clip_grad=0.5,
                             use_distributed_optimizer=True)
    without = _error(lambda: get_megatron_optimizer(config, [ddp]))
    with cuda_factories_on_cpu():
        optimizer = get_megatron_optimizer(config, [ddp])
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=0.1)
    norms, ref_norms = [], []
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + state.dp_rank))
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        ddp(x).pow(2).sum().backward()
        ddp.finish_grad_sync()
        with cuda_factories_on_cpu():
            norms.append(optimizer.step()[1])

        ref_optimizer.zero_grad()
        reference(x).pow(2).sum().backward()
        for ref in reference.parameters():
            dist.all_reduce(ref.grad, group=state.dp_group)
            ref.grad /= state.dp
        ref_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5).item())
        ref_optimizer.step()
    return {
        "without": without,
        "norms": norms,
        "ref_norms": ref_norms,
        "param_diff": max(_max_diff(p, r) for p, r in zip(model.parameters(), reference.parameters())),
    }


def _clip_type_assert():
    """The Tensor.type() answer of the scope is what megatron's fp32 clip asserts on (clip_grads.py:174)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.full((2,), 3.0)
    without = _error(lambda: clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=6.0))
    with cuda_factories_on_cpu():
        clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=6.0)
    return {"without": without, "clipped": param.grad.tolist()}


def compat_cases(ckpt_dir):
    from megatron.core.tensor_parallel import random as megatron_random

    originals = {name: getattr(torch.cuda, name) for name in PATCHED_CUDA_FUNCTIONS}
    originals["_set_cuda_rng_state"] = megatron_random._set_cuda_rng_state
    state = init_parallel(tp=2)  # applies the layer
    layer_fn = torch.cuda.current_device
    results = {
        "patched": [getattr(torch.cuda, n) is not originals[n] for n in PATCHED_CUDA_FUNCTIONS],
        "apply_again": apply_cpu_compat(),
        "apply_again_kept_patch": torch.cuda.current_device is layer_fn,
        "rng_log_filters": len(logging.getLogger(megatron_random.__name__).filters),
        "current_device": str(torch.cuda.current_device()),
        "column_parallel": _column_parallel_gather_output(state, originals),
        "rng": _rng_routed_to_cpu(state, originals),
    }
    saved = _checkpoint_save(state, originals, ckpt_dir)
    results["checkpoint_save"] = {k: v for k, v in saved.items() if k != "full"}

    destroy_parallel(keep_default_group=True)
    state = init_parallel(tp=1)
    results["checkpoint_load"] = _checkpoint_load_at_tp1(state, ckpt_dir, saved["full"])
    results["ddp"] = _ddp_finish_grad_sync(state, originals)
    results["schedule"] = _schedule_with_custom_loss(state)
    results["optimizer"] = _distributed_optimizer_steps(state)
    results["clip"] = _clip_type_assert()
    destroy_parallel()
    return results
