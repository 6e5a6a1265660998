"""megatron_omni.trainer.grad_flush: main_grad accumulated by batched adds once per micro-batch is bit-identical
to megatron DDP's per-parameter hooks (LoRA and full fine-tuning, one rank, TP=2 and DP=2 over 2 gloo ranks),
and the policy uses it only where the layout allows."""
import pytest
import torch

from checkpoints_convert.qwen_image import qwen_image_rules
from megatron_omni.algorithms.flow_grpo import FlowGRPOLossConfig
from megatron_omni.algorithms.flow_grpo.step import FlowGRPOMicroBatch, flow_grpo_forward_step
from megatron_omni.parallel.state import destroy_parallel, init_parallel
from megatron_omni.parallel.testing import run_distributed
from megatron_omni.trainer.grad_flush import GradFlush, batchable
from megatron_omni.trainer.policy import build_policy, run_microbatches
from model_specs.common.lora import FLOW_GRPO_TARGETS, apply_lora
from tests.qwen_image_reference import tiny_config

FHW = (1, 4, 4)


def _micro_batches(arch, count: int, seed: int, dtype) -> list[FlowGRPOMicroBatch]:
    g = torch.Generator().manual_seed(seed)
    n, b = FHW[0] * FHW[1] * FHW[2], 2
    out = []
    for _ in range(count):
        t = torch.rand(b, generator=g) * 0.6 + 0.3
        out.append(FlowGRPOMicroBatch(
            x_t=torch.randn(b, n, arch.in_channels, generator=g),
            txt=torch.randn(b, 5, arch.joint_attention_dim, generator=g).to(dtype),
            txt_mask=None, img_fhw=FHW, x_next=torch.randn(b, n, arch.in_channels, generator=g), t=t, t_next=t - 0.2,
            old_log_prob=torch.zeros(b), advantage=torch.randn(b, generator=g), noise_level=0.7, sigma_1=0.95))
    return out


def _lora(module):
    torch.manual_seed(1)
    apply_lora(module, 4, 8.0, FLOW_GRPO_TARGETS, qwen_image_rules(module.arch), seed=3)
    for name, p in module.named_parameters():
        if name.endswith("lora_B"):
            p.data.normal_(std=0.1)  # nonzero, as after some training


def _two_steps(state, batched: bool, lora: bool, dtype=torch.float32) -> tuple[list[torch.Tensor], list[float], int]:
    """Parameters after two optimizer steps of 3 micro-batches each (per-rank data), the grad norms, and the
    flushes made; the model starts from one seed on every rank."""
    arch = tiny_config()
    torch.manual_seed(0)
    policy = build_policy(arch, state, lr=1e-2, clip_grad=1.0, dtype=dtype, prepare=_lora if lora else None,
                          batched_grads=batched)
    assert (policy.grad_flush is not None) == batched
    assert (len(policy.model.grad_accs) == 0) == batched  # no per-parameter hook when batched
    step = flow_grpo_forward_step(FlowGRPOLossConfig(clip_range=1e-4))
    norms = []
    for k in range(2):
        mbs = _micro_batches(arch, 3, seed=10 * k + state.dp_rank, dtype=dtype)
        run_microbatches(policy, step, mbs, forward_only=True)  # a forward-only pass between steps: nothing to add
        _, grad_norm = run_microbatches(policy, step, mbs)
        norms.append(float(grad_norm))
    trained = [p.detach().clone() for p in policy.module.parameters() if p.requires_grad]
    return trained, norms, policy.grad_flush.flushes if batched else 0


def _compare(state, lora: bool, dtype=torch.float32):
    (p_hook, n_hook, _), (p_flush, n_flush, flushes) = (_two_steps(state, b, lora, dtype) for b in (False, True))
    assert flushes == 6  # one per micro-batch (5 before a forward, the last before finalize) x 2 steps
    assert n_hook == n_flush and all(n > 0 for n in n_hook)
    assert len(p_hook) == len(p_flush) and all(torch.equal(a, b) for a, b in zip(p_hook, p_flush))


@pytest.mark.parametrize("lora,dtype", [(True, torch.float32), (False, torch.float32), (True, torch.bfloat16)],
                         ids=["lora", "full", "lora-bf16"])
def test_batched_accumulation_is_bit_identical_to_megatron_hooks(single_rank, lora, dtype):
    """bf16: the parameters' bf16 gradients added into DDP's fp32 main_grad, as on the GPU."""
    _compare(single_rank, lora, dtype)


def _two_rank_worker():
    layouts = []
    for tp in (2, 1):  # tensor parallel (LoRA A replicated, B split), then data parallel
        state = init_parallel(tp=tp, seed=0, device="cpu")
        try:
            _compare(state, lora=True)
            layouts.append((state.tp, state.dp))
        finally:
            destroy_parallel(keep_default_group=True)
    return layouts


def test_batched_accumulation_under_tp_and_dp_2_ranks():
    assert run_distributed(_two_rank_worker, world_size=2, timeout_s=300) == [[(2, 1), (1, 2)]] * 2


def test_batched_by_default_for_adapters_only(single_rank):
    arch = tiny_config()
    lora = build_policy(arch, single_rank, lr=1e-2, prepare=_lora)
    full = build_policy(arch, single_rank, lr=1e-2)
    assert lora.grad_flush is not None and len(lora.model.grad_accs) == 0
    # DDP's buffer holds the adapters' main_grads back to back: one span, one concatenation and one add a flush
    assert [len(run) for _, run in lora.grad_flush._spans()] == [len(lora.grad_flush.params)]
    assert full.grad_flush is None and len(full.model.grad_accs) == sum(p.requires_grad for p in full.module.parameters())


def test_layouts_that_keep_megatrons_hooks():
    assert batchable(pp=1, chunks=1, overlap_grad_reduce=False)
    assert not batchable(pp=2, chunks=1, overlap_grad_reduce=False)  # 1F1B runs backwards back to back
    assert not batchable(pp=1, chunks=2, overlap_grad_reduce=False)
    assert not batchable(pp=1, chunks=1, overlap_grad_reduce=True)  # needs the per-parameter ready signal


def test_flush_needs_ddp_buffers():
    with pytest.raises(ValueError, match="without a main_grad .* build megatron's DistributedDataParallel"):
        GradFlush([torch.nn.Parameter(torch.zeros(3))])


def test_flush_adds_span_by_span_as_the_per_tensor_adds(monkeypatch):
    """main_grads laid out in a buffer in another order than the parameters, with a gap, bf16 gradients (the
    fused multi-tensor path refuses mixed dtypes): the spans' adds equal per-tensor adds bit for bit; spans split at
    the gap and at FLAT_SPAN elements."""
    import megatron_omni.trainer.grad_flush as grad_flush

    monkeypatch.setattr(grad_flush, "FLAT_SPAN", 40)
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (10,), (2, 5), (30,), (7,)]
    buffer = torch.randn(200, generator=g)
    offsets = [90, 70, 60, 0, 80]  # (7,) at 80 ends at 87, then a gap to 90; (30,) alone at 0
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in shapes]
    for p, o in zip(params, offsets):
        p.main_grad = buffer[o:o + p.numel()].view(p.shape)
    want = buffer.clone()
    flush = GradFlush(params)
    for _ in range(2):  # two micro-batches
        grads = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
        for p, grad, o in zip(params, grads, offsets):
            p.grad = grad
            want[o:o + grad.numel()].add_(grad.reshape(-1))
        flush.flush()
        assert all(p.grad is None for p in params)
    assert torch.equal(buffer, want)
    spans = [[p.main_grad.storage_offset() for p in run] for _, run in flush._spans()]
    assert spans == [[0], [60, 70, 80], [90]]  # the gap at 87 and the 40-element cap split the runs
    assert flush.flushes == 2
    params[1].main_grad = torch.zeros(10)  # another tensor: the plan follows it
    for p in params:
        p.grad = torch.ones(p.shape, dtype=torch.bfloat16)
    flush.flush()
    assert torch.equal(params[1].main_grad, torch.ones(10)) and torch.equal(buffer[70:80], want[70:80])
    assert torch.equal(buffer[60:70], want[60:70] + 1)
