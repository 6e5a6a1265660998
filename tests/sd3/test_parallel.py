"""Tensor, context and pipeline parallelism of the SD3 model against diffusers, float32, on 2 gloo ranks in ONE
launch (layouts re-initialised on the same processes): TP=2, CP=2 Ulysses, CP=2 ring (joint attention with the
text whole on every rank; the MMDiT-X attn2 over the split image tokens alone) and PP=2 through megatron-core's
1F1B schedule (the timestep and pooled-text embedders replicated on both stages), for the 3.5-M and 3.5-L tiny
shapes; one forward case with padded text (a mask) at every layout."""
import pytest
import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from checkpoints_convert.convert import mcore_state_from_hf
from megatron_omni.parallel import cuda_factories_on_cpu
from megatron_omni.parallel.pipeline import broadcast_from_last_stage
from megatron_omni.parallel.state import destroy_parallel, init_parallel
from megatron_omni.parallel.testing import run_distributed
from megatron_omni.trainer.policy import build_chunks, policy_transformer_config
from tests.sd3.reference import SHAPES, diffusers_reference, make_inputs, reference_forward, rel_err, tiny_config

pytestmark = pytest.mark.numerics

TOL = 1e-5
CASES = [(2, 5, (3, 4)), (3, 4, (6, 2)), (1, 7, (5, 4))]  # image tokens even: they split over CP=2
GRAD_CASE = CASES[0]
MASKED_CASE, REAL_TOKENS = (2, 6, (3, 4)), (6, 4)  # row 1's last two text tokens are padding
# (tp, cp, ulysses, pp, pipeline layout)
LAYOUTS = [(2, 1, 1, 1, None), (1, 2, 2, 1, None), (1, 2, 1, 1, None), (1, 1, 1, 2, (2, 1))]
MIXED = [(2, 2, 2, 1, None), (2, 2, 1, 1, None), (2, 1, 1, 2, (1, 2))]  # on 4 ranks


def _weights(arch, batch, n_img):
    return torch.randn(batch, n_img, arch.out_features, generator=torch.Generator().manual_seed(5))


def _reference(arch, ref):
    """diffusers' outputs of every case and its HF-named gradients of <out, g> on GRAD_CASE."""
    with torch.no_grad():
        outs = [reference_forward(ref, arch, *make_inputs(arch, *case), case[2]) for case in CASES]
        # with a padding mask: each row as diffusers on its real tokens alone (test_parity.py says why)
        img, txt, pooled, sigma = make_inputs(arch, *MASKED_CASE)
        outs.append(torch.cat([reference_forward(ref, arch, img[b:b + 1], txt[b:b + 1, :n], pooled[b:b + 1],
                                                 sigma[b:b + 1], MASKED_CASE[2]) for b, n in enumerate(REAL_TOKENS)]))
    batch, text_len, grid = GRAD_CASE
    ref.zero_grad()
    (reference_forward(ref, arch, *make_inputs(arch, *GRAD_CASE), grid) * _weights(arch, batch, grid[0] * grid[1])
     ).sum().backward()
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}
    grads["pos_embed.pos_embed"] = ref.pos_embed.pos_embed  # a buffer: no gradient
    return outs, grads


def _forward_step(data_iterator, model):
    img, txt, pooled, sigma, grid, mask, g = next(data_iterator)

    def loss_func(out, non_loss_data=False):
        return out.detach() if non_loss_data else ((out * g).sum(), {})

    return model(img, txt, sigma, (1, *grid), mask, pooled), loss_func


def _run(chunks, batch, forward_only):
    with cuda_factories_on_cpu():
        return get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iter([batch]), model=chunks, num_microbatches=1,
            seq_length=1, micro_batch_size=1, forward_only=forward_only, collect_non_loss_data=forward_only)


def _grad_errors(chunks, arch, ref_grads, state):
    """This rank's gradients after what finalize_model_grads would do: DDP's mean over CP (each rank holds its
    share of the loss, which megatron's schedule multiplies by cp_size), q / k norm grads summed over TP (each
    rank's are partial sums over its heads; config.qk_layernorm), the replicated embedders summed over PP."""
    expected = mcore_state_from_hf(arch, ref_grads.__getitem__, state.tp_rank, state.tp)
    errs = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            grad = p.grad.clone()
            if state.cp > 1:
                dist.all_reduce(grad, group=state.cp_group)
                grad /= state.cp
            if state.tp > 1 and ("q_layernorm" in name or "k_layernorm" in name):
                dist.all_reduce(grad, group=state.tp_group)
            if state.pp > 1 and getattr(p, "pipeline_parallel", False):
                dist.all_reduce(grad, group=state.pp_group)
            errs[name] = rel_err(grad, expected[name])
    return errs


def _layout_results(arch, ref, refs, state, layout):
    config = policy_transformer_config(arch, state, torch.float32)
    config.perform_initialization, config.finalize_model_grads_func = False, None
    chunks = build_chunks(arch, state, config, layout=layout)
    full = mcore_state_from_hf(arch, ref.state_dict().__getitem__, state.tp_rank, state.tp)
    for chunk in chunks:
        chunk.load_state_dict({k: v for k, v in full.items() if k in chunk.state_dict()}, strict=True)
    ref_outs, ref_grads = refs
    fwd = []
    mask = torch.arange(MASKED_CASE[1])[None] < torch.tensor(REAL_TOKENS)[:, None]
    for case, expected in zip([*CASES, MASKED_CASE], ref_outs):
        batch = (*make_inputs(arch, *case), case[2], mask if case is MASKED_CASE else None, None)
        out = broadcast_from_last_stage(_run(chunks, batch, forward_only=True), state.pp_group)[0]
        fwd.append(rel_err(out, expected))
    batch, text_len, grid = GRAD_CASE
    _run(chunks, (*make_inputs(arch, *GRAD_CASE), grid, None, _weights(arch, batch, grid[0] * grid[1])),
         forward_only=False)
    return fwd, _grad_errors(chunks, arch, ref_grads, state)


def _worker(layouts, shapes):
    results = {}
    for shape in shapes:
        arch = tiny_config(**SHAPES[shape])
        ref = diffusers_reference(arch)
        refs = _reference(arch, ref)
        for tp, cp, ulysses, pp, layout in layouts:
            state = init_parallel(tp=tp, cp=cp, pp=pp, ulysses=ulysses, seed=0, device="cpu")
            results[(shape, tp, cp, ulysses, pp)] = _layout_results(arch, ref, refs, state, layout)
            destroy_parallel(keep_default_group=True)
    dist.destroy_process_group()
    return results


def _check(per_rank):
    for key in per_rank[0]:
        fwd = max(max(r[key][0]) for r in per_rank)
        name, err = max(((n, e) for r in per_rank for n, e in r[key][1].items()), key=lambda x: x[1])
        print(f"shape,tp,cp,ulysses,pp={key}: forward rel err {fwd:.2e}, worst grad {name} {err:.2e}")
        assert fwd <= TOL and err <= TOL, (key, fwd, name, err)


def test_tp_cp_pp_forward_and_gradient_parity_2_ranks():
    _check(run_distributed(_worker, world_size=2, args=(LAYOUTS, tuple(SHAPES)), timeout_s=600))


def test_tp2_with_cp2_and_pp2_parity_4_ranks():
    """TP=2 x CP=2 (Ulysses re-splits a TP rank's heads; ring) and TP=2 x PP=2, the 3.5-M shape."""
    _check(run_distributed(_worker, world_size=4, args=(MIXED, ("3.5-M",)), timeout_s=600))
