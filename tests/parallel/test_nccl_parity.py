"""Qwen-Image parity over NCCL in bf16 on 2 GPUs (marker ``gpu``; skips itself with fewer than 2):
TP=2, CP=2 (Ulysses), CP=2 (ring) and PP=2 (through megatron-core's 1F1B schedule) against the TP=1
model on the same GPU, forward outputs and every parameter's gradient, relative error <= 1e-2.

The CPU suite proves the same layouts exact in float32 over gloo (test_usp.py, test_pp.py); this one
proves the NCCL collectives, the CUDA kernels and bf16 rounding do not break them.  One launch of 2
ranks runs every layout (re-initialising the groups on the same processes).

    python -m pytest -q -m gpu tests/parallel/test_nccl_parity.py -s
"""
import contextlib

import pytest
import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from checkpoints_convert.convert import hf_state_from_mcore, mcore_state_from_hf
from megatron_omni.parallel import cuda_factories_on_cpu
from megatron_omni.parallel.pipeline import broadcast_from_last_stage
from megatron_omni.parallel.state import destroy_parallel, init_parallel
from megatron_omni.parallel.testing import run_distributed
from megatron_omni.trainer.policy import build_chunks, policy_transformer_config
from tests.parallel.test_usp import grad_errors
from tests.qwen_image_reference import diffusers_reference, make_inputs, megatron_from_reference, rel_err, tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

BF16_TOL = 1e-2
# wide enough that bf16 rounding of real-size matmuls shows: hidden 1024, 8 heads of 128, 4 blocks
ARCH = dict(num_layers=4, attention_head_dim=128, num_attention_heads=8, joint_attention_dim=512,
            axes_dims_rope=(16, 56, 56))
# batch 2, 32 text tokens (the second sample with 9 padding tokens), a 16 x 24 token grid (384 image tokens)
CASE = (2, 32, (1, 16, 24), [0, 9])
# the first layout has TP=1, so the TP=1 reference is computed there
LAYOUTS = {"CP=2 Ulysses": dict(cp=2, ulysses=2), "CP=2 ring": dict(cp=2, ulysses=1), "TP=2": dict(tp=2),
           "PP=2": dict(pp=2)}


def _inputs(arch, dev):
    batch, text_len, fhw, pad = CASE
    img, txt, sigma, mask = make_inputs(arch, batch, text_len, fhw, pad)
    g = torch.randn(batch, img.shape[1], arch.out_features, generator=torch.Generator().manual_seed(5))
    return img.to(dev, torch.bfloat16), txt.to(dev, torch.bfloat16), sigma.to(dev), fhw, mask.to(dev), g.to(dev)


def _tp1_run(arch, ref, state, dtype):
    """TP=1 output and HF-named gradients of <out, g>, computed on this rank's GPU in ``dtype``."""
    model = megatron_from_reference(ref, arch, state.tp_group).to(state.torch_device, dtype)
    img, txt, sigma, fhw, mask, g = _inputs(arch, state.torch_device)
    out = model(img.to(dtype), txt.to(dtype), sigma, fhw, mask)
    (out.float() * g).sum().backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    return out.detach().float(), dict(hf_state_from_mcore(arch, grads.__getitem__))


def _reference(arch, ref, state):
    """The bf16 TP=1 output and gradients, and per gradient (Megatron name) its bf16 noise: the relative
    error of the bf16 TP=1 gradient against the float32 one."""
    out16, grads16 = _tp1_run(arch, ref, state, torch.bfloat16)
    _, grads32 = _tp1_run(arch, ref, state, torch.float32)
    m16, m32 = (mcore_state_from_hf(arch, g.__getitem__, 0, 1) for g in (grads16, grads32))
    return out16, grads16, {n: rel_err(m16[n], m32[n]) for n in m16}


def _load(module, arch, ref, state):
    full = mcore_state_from_hf(arch, ref.state_dict().__getitem__, state.tp_rank, state.tp)
    own = module.state_dict()
    module.load_state_dict({k: v for k, v in full.items() if k in own}, strict=True)


def _layout_run(arch, ref, state, ref_grads):
    """(full output, this rank's per-parameter grad errors) at ``state``'s layout; PP through 1F1B."""
    config = policy_transformer_config(arch, state, torch.bfloat16)
    config.finalize_model_grads_func = None  # raw gradients: grad_errors does the reductions
    chunks = build_chunks(arch, state, config)
    for chunk in chunks:
        _load(chunk, arch, ref, state)
        chunk.to(state.torch_device, torch.bfloat16)  # norms too, as megatron's Float16Module casts them
    img, txt, sigma, fhw, mask, g = _inputs(arch, state.torch_device)
    if state.pp == 1:  # CP splits and gathers the image tokens inside the model: full in, full out
        out = chunks[0](img, txt, sigma, fhw, mask)
        (out.float() * g).sum().backward()
        out = out.detach().float()
    else:
        def forward_step(data_iterator, model):
            out = model(*next(data_iterator))
            return out, lambda o: ((o.float() * g).sum(), {"out": o.detach().float()})

        on_cpu = cuda_factories_on_cpu() if state.torch_device.type == "cpu" else contextlib.nullcontext()
        with on_cpu:  # the gloo dry run of this test (see _worker)
            stored = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([(img, txt, sigma, fhw, mask)]), model=chunks,
                num_microbatches=1, seq_length=1, micro_batch_size=1, forward_only=False)
        out = broadcast_from_last_stage(stored[0]["out"].cpu() if stored else None, state.pp_group)
    return out.to(state.torch_device), grad_errors(chunks[0], arch, ref_grads, state)


def _worker(device: str = "cuda"):
    """Every layout on this rank; ``device="cpu"`` (gloo) is a dry run of the script itself."""
    arch = tiny_config(**ARCH)
    ref = diffusers_reference(arch)  # float32 on the CPU, the same weights on both ranks (seeded)
    expected, results = None, {}
    for name, layout in LAYOUTS.items():
        state = init_parallel(seed=0, device=device, **layout)
        if expected is None:  # the first layout has TP=1 (a tp_group of one): the reference runs there
            expected = _reference(arch, ref, state)
        out, errs = _layout_run(arch, ref, state, expected[1])
        results[name] = (rel_err(out, expected[0]), errs, expected[2])
        destroy_parallel(keep_default_group=True)
    dist.destroy_process_group()
    return results


def test_bf16_parity_over_nccl_2_gpus():
    per_rank = run_distributed(_worker, world_size=2, backend="nccl", timeout_s=600)
    failures = []
    for name in LAYOUTS:
        fwd = max(r[name][0] for r in per_rank)
        # a gradient may differ from TP=1's by 1e-2 or by twice bf16's own error on it, whichever is larger
        # (a norm weight's gradient sums thousands of bf16 products: its rounding alone reaches ~1e-2)
        errs = [(n, e, noise[n])
                for r in per_rank for noise in [r[name][2]] for n, e in r[name][1].items()]
        worst = max(errs, key=lambda x: x[1] / max(BF16_TOL, 2 * x[2]))
        print(f"{name}: forward rel err {fwd:.2e} (vs TP=1 bf16); worst grad {worst[0]} {worst[1]:.2e} "
              f"(its bf16 noise {worst[2]:.2e})")
        if fwd > BF16_TOL or worst[1] > max(BF16_TOL, 2 * worst[2]):
            failures.append((name, fwd, worst))
    assert not failures, failures
