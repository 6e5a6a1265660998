"""USP (Ulysses x ring) context parallelism: forward and gradient parity of the Qwen-Image model at CP=2
(Ulysses only, ring only), TP=2 x CP=2 and CP=4 (2 x 2) with the single-process TP=1 model, float32,
on 4 gloo ranks in ONE launch (layouts are re-initialised on the same processes)."""
import pytest
import torch
import torch.distributed as dist

from checkpoints_convert.convert import hf_state_from_mcore, mcore_state_from_hf
from megatron_omni.parallel.state import destroy_parallel, init_parallel
from megatron_omni.parallel.testing import run_distributed
from model_specs.common.fusion import fuse_inference
from model_specs.qwen_image.model import QwenImageModel
from model_specs.qwen_image.spec import qwen_image_block_spec
from tests.qwen_image_reference import (
    diffusers_reference, make_inputs, megatron_from_reference, rel_err, tiny_config,
)

pytestmark = pytest.mark.numerics  # CP / TP layouts against the TP=1 model in float32

TOL = 1e-5
# (batch, text_len, token grid (frames, height, width), padding tokens per sample or None); image tokens
# divisible by 4 so that every layout splits them
CASES = [(2, 7, (1, 4, 6), [0, 3]), (3, 5, (1, 6, 4), None), (2, 4, (2, 2, 4), [1, 0])]
GRAD_CASE = CASES[0]
# (tp, cp, ulysses, pp)
LAYOUTS = [(1, 2, 2, 1), (1, 2, 1, 1), (2, 2, 2, 1), (2, 2, 1, 1), (1, 4, 2, 1), (1, 4, 4, 1), (1, 4, 1, 1)]


def _loss_weights(arch, batch, n_img):
    return torch.randn(batch, n_img, arch.out_features, generator=torch.Generator().manual_seed(5))


def reference_results(arch, ref, tp1_group):
    """Outputs of every case and HF-named gradients of <out, g> on GRAD_CASE, from the TP=1 model."""
    model = megatron_from_reference(ref, arch, tp1_group)
    outs = []
    with torch.no_grad():
        for batch, text_len, fhw, pad in CASES:
            img, txt, sigma, mask = make_inputs(arch, batch, text_len, fhw, pad)
            outs.append(model(img, txt, sigma, fhw, mask))
    batch, text_len, fhw, pad = GRAD_CASE
    img, txt, sigma, mask = make_inputs(arch, batch, text_len, fhw, pad)
    (model(img, txt, sigma, fhw, mask) * _loss_weights(arch, batch, img.shape[1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return outs, dict(hf_state_from_mcore(arch, grads.__getitem__))


def parallel_model(arch, ref, state, pre_process=True, post_process=True, layers=None):
    """A TP/CP/PP-placed model holding the reference's weights (global names through the mapping table)."""
    config = arch.transformer_config(state.tp, perform_initialization=False)
    model = QwenImageModel(arch, config, state.tp_group, qwen_image_block_spec("local", context_parallel=state.cp > 1),
                           cp_groups=state.cp_groups, pre_process=pre_process, post_process=post_process,
                           layers=layers)
    full = mcore_state_from_hf(arch, ref.state_dict().__getitem__, state.tp_rank, state.tp)
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in full.items() if k in own}, strict=True)
    return model


def grad_errors(model, arch, ref_hf_grads, state):
    """Per-parameter relative error of this rank's gradients, after the reductions megatron's
    finalize_model_grads would do: sum over CP (each CP rank holds its share), QK-norm sum over TP,
    the replicated timestep embedder summed over PP."""
    expected = mcore_state_from_hf(arch, ref_hf_grads.__getitem__, state.tp_rank, state.tp)
    errs = {}
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        if state.cp > 1:
            dist.all_reduce(grad, group=state.cp_group)
        if state.tp > 1 and ("q_layernorm" in name or "k_layernorm" in name):
            dist.all_reduce(grad, group=state.tp_group)
        if state.pp > 1 and getattr(p, "pipeline_parallel", False):
            dist.all_reduce(grad, group=state.pp_group)
        errs[name] = rel_err(grad, expected[name])
    return errs


def _usp_worker():
    arch = tiny_config()
    ref = diffusers_reference(arch)
    results = {}
    for tp, cp, ulysses, pp in LAYOUTS:
        state = init_parallel(tp=tp, cp=cp, pp=pp, ulysses=ulysses, seed=0, device="cpu")
        if "ref" not in results:
            results["ref"] = reference_results(arch, ref, state.tp_group)  # first layout has TP=1
        ref_outs, ref_grads = results["ref"]
        model = parallel_model(arch, ref, state)
        fwd = []
        with torch.no_grad():
            for (batch, text_len, fhw, pad), expected in zip(CASES, ref_outs):
                img, txt, sigma, mask = make_inputs(arch, batch, text_len, fhw, pad)
                fwd.append(rel_err(model(img, txt, sigma, fhw, mask), expected))
            # the rollout engine's inference fusions under USP too: the q / k norm + RoPE op writes the joint
            # [S, B, N, D] layout the CP attention takes (torch ops here: Triton runs on CUDA)
            assert fuse_inference(model, strict=True) == 3 * arch.num_layers
            for (batch, text_len, fhw, pad), expected in zip(CASES, ref_outs):
                img, txt, sigma, mask = make_inputs(arch, batch, text_len, fhw, pad)
                fwd.append(rel_err(model(img, txt, sigma, fhw, mask), expected))
            fuse_inference(model, enable=False)
        batch, text_len, fhw, pad = GRAD_CASE
        img, txt, sigma, mask = make_inputs(arch, batch, text_len, fhw, pad)
        (model(img, txt, sigma, fhw, mask) * _loss_weights(arch, batch, img.shape[1])).sum().backward()
        results[(tp, cp, ulysses, pp)] = (fwd, grad_errors(model, arch, ref_grads, state))
        destroy_parallel(keep_default_group=True)
    dist.destroy_process_group()
    results.pop("ref")
    return results


def test_usp_forward_and_gradient_parity_4_ranks():
    per_rank = run_distributed(_usp_worker, world_size=4, timeout_s=600)
    for layout in LAYOUTS:
        fwd = max(max(r[layout][0]) for r in per_rank)
        worst = max(((n, e) for r in per_rank for n, e in r[layout][1].items()), key=lambda x: x[1])
        print(f"tp,cp,ulysses,pp={layout}: forward rel err {fwd:.2e}, worst grad {worst[0]} {worst[1]:.2e}")
        assert fwd <= TOL, (layout, fwd)
        assert worst[1] <= TOL, (layout, worst)

