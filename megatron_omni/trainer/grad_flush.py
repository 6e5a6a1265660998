"""Gradient accumulation into megatron DDP's main_grad with a few batched adds per micro-batch, instead of one
Python hook and one add kernel per parameter per micro-batch.

Why: megatron-core's DDP hooks every trainable parameter's AccumulateGrad node with a Python function that adds
the parameter's gradient into its (fp32) ``main_grad``.  A LoRA r64 Qwen-Image has 1440 adapter tensors: 5760 hook
calls and add kernels per optimizer step of 4 micro-batches.  Between the compiled backward graphs of two blocks
the GPU then waits for the host to run 24 of them: in the compiled LoRA training step on an H200 the GPU sat idle
174 ms of a 2.46 s step in gaps that ended with such an add (``bench/_profile.idle_gaps``, bench/RESULTS.md).

How: the parameters are marked for megatron's own switch for "another party accumulates this weight gradient"
(``DistributedDataParallelConfig.delay_wgrad_compute`` with ``param.skip_backward_post_hook``: DDP then hooks the
parameter only through a module's ``register_wgrad_accumulation_and_reduce_hooks``, which no module of ours has),
so autograd leaves each backward's gradient in ``param.grad`` (the first AccumulateGrad keeps the tensor: no
kernel).  ``GradFlush.flush`` then does ``main_grad += grad`` for all of them, a span of adjacent main_grads at a
time (the span's gradients concatenated, one add; ``GradFlush._spans``), and drops the grads.  It runs before
every forward of the model (a forward pre-hook: the previous micro-batch's backward is done by then) and before
``finalize_model_grads`` (the last micro-batch).  These are the adds the hook made, in the same order: ``main_grad``
is bit-identical (tests/trainer/test_grad_flush.py).

Only where every backward is followed by a forward or the end of the step: no pipelining (pp == 1, one chunk) and
no overlapped gradient reduction (``overlap_grad_reduce`` needs the per-parameter ready signal).  And by default
only when few parameters train (adapters): a micro-batch's gradients now live until its flush instead of being
freed one by one as the hooks add them, which for full fine-tuning is a bf16 copy of the model at the end of each
backward.  Elsewhere the policy keeps megatron's hooks.
"""
from __future__ import annotations

import torch


def batchable(pp: int, chunks: int, overlap_grad_reduce: bool) -> bool:
    """Whether a policy of this layout can accumulate through ``GradFlush`` (see the module docstring)."""
    return pp == 1 and chunks == 1 and not overlap_grad_reduce


# elements of one concatenated span of gradients in ``GradFlush.flush`` (64 Mi: 128 MiB of bf16 at a time)
FLAT_SPAN = 1 << 26

# trained share of the parameters up to which batching is worth its memory (LoRA r64 on Qwen-Image: 2 %)
BATCH_UP_TO = 0.1


def worth_batching(module: torch.nn.Module) -> bool:
    """Whether few enough of ``module``'s parameters train that keeping a micro-batch's gradients until its flush
    costs nothing worth counting (adapters: yes; full fine-tuning: +2 bytes per trained bf16 parameter, no)."""
    total = sum(p.numel() for p in module.parameters())
    return sum(p.numel() for p in module.parameters() if p.requires_grad) <= BATCH_UP_TO * total


def mark_for_flush(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Mark ``module``'s trainable parameters so that megatron DDP (built with ``delay_wgrad_compute=True``) leaves
    their accumulation to a ``GradFlush``; call before building the DDP.  Returns them."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.skip_backward_post_hook = True
    return params


class GradFlush:
    """``main_grad += grad`` for every marked parameter of a DDP-wrapped module, a span of DDP's buffer at a time."""

    def __init__(self, params: list[torch.nn.Parameter]):
        missing = [tuple(p.shape) for p in params if getattr(p, "main_grad", None) is None]
        if missing:
            raise ValueError(f"GradFlush: {len(missing)} parameter(s) without a main_grad (e.g. shape {missing[0]}); "
                             f"build megatron's DistributedDataParallel over them first")
        self.params = params
        self._span_plan: list | None = None  # built at the first flush (``_spans``), for these main_grads:
        self._span_grads: list[torch.Tensor] = []
        self.flushes = 0  # flushes that moved at least one gradient (the tests count them)

    @torch.no_grad()
    def flush(self) -> None:
        # (megatron's optimizer points an fp32 parameter's .grad at its main_grad for its step: not a new gradient)
        pending = [p for p in self.params if p.grad is not None and p.grad.data_ptr() != p.main_grad.data_ptr()]
        if not pending:
            return
        if len(pending) == len(self.params) and len({p.grad.dtype for p in pending}) == 1:
            for span, params in self._spans():
                span.add_(torch.cat([p.grad.reshape(-1) for p in params]) if len(params) > 1 else
                          params[0].grad.reshape(-1))
        else:
            torch._foreach_add_([p.main_grad for p in pending], [p.grad for p in pending])
        for p in pending:
            p.grad = None
        self.flushes += 1

    def _spans(self) -> list[tuple[torch.Tensor, list[torch.nn.Parameter]]]:
        """(a 1-D view of the main_grad buffer, the parameters whose main_grads tile it in order): runs of adjacent
        main_grads, at most ``FLAT_SPAN`` elements each unless one parameter is larger.

        Why: ``torch._foreach_add_`` has a fused path only for lists of one dtype.  bf16 gradients into fp32
        main_grads take its per-tensor fallback: one add kernel per adapter tensor per micro-batch, launched from
        the main thread (3840 per optimizer step in the H100 profile of bench/RESULTS.md, 2026-12-07).  A span's
        gradients concatenated (a few batched copies) and added into the span (one kernel) make the same
        element-wise adds, so main_grad is unchanged bit for bit; the concatenation costs at most ``FLAT_SPAN``
        elements of the gradients' dtype.  The plan is made again whenever a parameter's main_grad is another
        tensor than when it was made (a view follows its storage through megatron's offload / reload)."""
        if self._span_plan is None or any(p.main_grad is not g for p, g in zip(self.params, self._span_grads)):
            self._span_grads = [p.main_grad for p in self.params]
            plan: list[tuple[torch.Tensor, list]] = []
            run: list = []
            end, numel = None, 0  # where the run's last main_grad ends (storage, dtype, offset); the run's elements
            for p in sorted(self.params, key=lambda p: (p.main_grad.untyped_storage().data_ptr(),
                                                       p.main_grad.storage_offset())):
                g = p.main_grad
                start = (g.untyped_storage().data_ptr(), g.dtype, g.storage_offset())
                if run and (start != end or numel + g.numel() > FLAT_SPAN):
                    plan.append(self._span(run, numel))
                    run, numel = [], 0
                run.append(p)
                numel += g.numel()
                end = (*start[:2], start[2] + g.numel())
            plan.append(self._span(run, numel))
            self._span_plan = plan
        return self._span_plan

    @staticmethod
    def _span(run: list[torch.nn.Parameter], numel: int) -> tuple[torch.Tensor, list[torch.nn.Parameter]]:
        """The 1-D view of the ``numel`` elements of DDP's buffer that ``run``'s adjacent main_grads tile."""
        first = run[0].main_grad
        if not all(p.main_grad.is_contiguous() for p in run):
            raise ValueError("GradFlush: a main_grad that is not contiguous in DDP's buffer")
        return first.as_strided((numel,), (1,), first.storage_offset()), run

    def install(self, module: torch.nn.Module, config) -> None:
        """Flush before every forward of ``module`` and before ``config.finalize_model_grads_func``."""
        module.register_forward_pre_hook(lambda *unused: self.flush())
        finalize = config.finalize_model_grads_func

        def flush_then_finalize(*args, **kwargs):
            self.flush()
            return finalize(*args, **kwargs)

        config.finalize_model_grads_func = flush_then_finalize
