"""Pipeline parallelism of the Qwen-Image model inside megatron-core's schedules (4 gloo ranks, one launch):

* forward and gradient parity with the single-process TP=1 model at PP=2 (even and uneven layouts) and
  TP=2 x PP=2, float32, through ``forward_backward_func`` (1F1B);
* FlowGRPO: the losses of 3 optimizer steps (4 micro-batches, one with true CFG, so the boundary shape
  changes between micro-batches) at PP=2, PP=2 interleaved (vpp=2), TP=2 x PP=2 and CP=2 x PP=2 equal
  PP=1's; the forward-only log-prob recomputation (collect_non_loss_data) equals PP=1's; the replicated
  timestep embedder stays identical on both pipeline stages.
"""
import pytest
import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from checkpoints_convert.convert import mcore_state_from_hf
from megatron_omni.algorithms.flow_grpo import FlowGRPOLossConfig
from megatron_omni.algorithms.flow_grpo.step import flow_grpo_forward_step
from megatron_omni.parallel import cuda_factories_on_cpu
from megatron_omni.parallel.pipeline import broadcast_from_last_stage
from megatron_omni.parallel.state import destroy_parallel, init_parallel
from megatron_omni.parallel.testing import run_distributed
from megatron_omni.trainer.policy import build_chunks, build_policy, policy_transformer_config, run_microbatches
from tests.algorithms.test_flow_grpo_step import _micro_batches
from tests.parallel.test_usp import CASES, GRAD_CASE, _loss_weights, grad_errors, reference_results
from tests.qwen_image_reference import diffusers_reference, make_inputs, megatron_from_reference, rel_err, tiny_config

pytestmark = pytest.mark.numerics  # PP / TP / CP layouts against PP=1 in float32

TOL, LOSS_TOL = 1e-5, 1e-6
# TP and CP change float32 summation orders (TP=2 vs TP=1 is itself ~1e-7 per forward), and 3 Adam steps
# amplify that; PP alone changes none inside a forward, so pure-PP layouts get the tight bounds
MIXED_LOSS_TOL, MIXED_LOGP_TOL = 1e-5, 1e-4
STEPS, LR = 3, 1e-3
# (tp, cp, pp, vpp, layout)
PARITY = [(1, 1, 2, None, None), (1, 1, 2, None, (1, 3)), (2, 1, 2, None, None)]
TRAIN = [(1, 1, 1, None, None), (1, 1, 2, None, None), (1, 1, 2, 2, None), (2, 1, 2, None, None),
         (1, 2, 2, None, None)]


def _flow_grpo_batches(model, arch):
    """4 micro-batches (one with true CFG: the boundary shape changes) and 4 of one shape for the
    interleaved schedule.  Advantages of one sign per micro-batch: a loss that is a difference of nearly
    equal terms would turn float32 rounding of the log-probs into large relative differences."""
    varying, fixed = _micro_batches(model, arch, count=4), _micro_batches(model, arch, count=4, cfg_index=-1)
    for i, mb in enumerate(varying + fixed):
        mb.advantage = torch.tensor([1.3, 0.6]) * (1 - 2 * (i % 2))
    return {"varying": varying, "fixed": fixed}


def _load(module, arch, ref, state):
    full = mcore_state_from_hf(arch, ref.state_dict().__getitem__, state.tp_rank, state.tp)
    own = module.state_dict()
    module.load_state_dict({k: v for k, v in full.items() if k in own}, strict=True)


def _forward_step(data_iterator, model):
    img, txt, sigma, fhw, mask, g = next(data_iterator)

    def loss_func(out, non_loss_data=False):
        return out.detach() if non_loss_data else ((out * g).sum(), {})

    return model(img, txt, sigma, fhw, mask), loss_func


def _schedule(chunks, batches, forward_only):
    with cuda_factories_on_cpu():
        return get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iter(batches), model=chunks, num_microbatches=len(batches),
            seq_length=1, micro_batch_size=1, forward_only=forward_only, collect_non_loss_data=forward_only)


def _parity(arch, ref, state, ref_results, layout):
    """Forward of every case and gradients of GRAD_CASE through the 1F1B schedule (no DDP: p.grad)."""
    config = policy_transformer_config(arch, state, torch.float32)
    config.finalize_model_grads_func = None  # gradients are checked raw, reduced by grad_errors
    chunks = build_chunks(arch, state, config, layout=layout)
    for chunk in chunks:
        _load(chunk, arch, ref, state)
    ref_outs, ref_grads = ref_results
    fwd = []
    for (batch, text_len, fhw, pad), expected in zip(CASES, ref_outs):
        img, txt, sigma, mask = make_inputs(arch, batch, text_len, fhw, pad)
        out = _schedule(chunks, [(img, txt, sigma, fhw, mask, None)], forward_only=True)
        out = broadcast_from_last_stage(out, state.pp_group)[0]
        fwd.append(rel_err(out, expected))
    batch, text_len, fhw, pad = GRAD_CASE
    img, txt, sigma, mask = make_inputs(arch, batch, text_len, fhw, pad)
    _schedule(chunks, [(img, txt, sigma, fhw, mask, _loss_weights(arch, batch, img.shape[1]))], forward_only=False)
    errs = {}
    for chunk in chunks:
        errs.update(grad_errors(chunk, arch, ref_grads, state))
    return fwd, errs


def _boundary(micro_batches):
    shapes = {(mb.txt.shape[1] + mb.x_t.shape[1], mb.x_t.shape[0] * (2 if mb.has_cfg else 1)) for mb in micro_batches}
    return shapes.pop() if len(shapes) == 1 else None


def _train(arch, ref, state, batches, kind=None):
    micro_batches = batches[kind or ("fixed" if state.vpp else "varying")]
    shape = _boundary(micro_batches)
    policy = build_policy(arch, state, lr=LR, clip_grad=1.0, prepare=lambda m: _load(m, arch, ref, state))
    # joint_uncond: the PP=1 baseline runs a CFG micro-batch's uncond rows in the one padded forward a pipeline
    # stage runs (on a whole model they get their own forward by default: other rounding, same math)
    forward_step = flow_grpo_forward_step(FlowGRPOLossConfig(clip_range=1e-4), joint_uncond=True)
    losses = []
    for _ in range(STEPS):
        metrics, _ = run_microbatches(policy, forward_step, micro_batches, boundary_shape=shape)
        losses.append([float(m["loss"]) for m in metrics])
    recomputed, _ = run_microbatches(policy, forward_step, micro_batches, forward_only=True,
                                     collect_non_loss_data=True, boundary_shape=shape)
    recomputed = torch.cat([d["log_prob"] for d in broadcast_from_last_stage(recomputed, state.pp_group)])
    # the timestep embedder is replicated on every (virtual) stage: it must be bit-identical everywhere
    embedder = torch.cat([p.detach().flatten() for m in policy.modules for n, p in m.named_parameters()
                          if n.startswith("time_linear")])
    gathered = [torch.empty_like(embedder) for _ in range(state.pp)]
    dist.all_gather(gathered, embedder, group=state.pp_group)
    spread = max((g - embedder).abs().max().item() for g in gathered)
    losses = broadcast_from_last_stage(losses, state.pp_group)
    return losses, recomputed, spread


def _pp_worker():
    arch = tiny_config(num_layers=4)
    ref = diffusers_reference(arch)
    results, ref_results, micro_batches = {}, None, None
    for tp, cp, pp, vpp, layout in PARITY + TRAIN:
        state = init_parallel(tp=tp, cp=cp, pp=pp, vpp=vpp, seed=0, device="cpu")
        if ref_results is None:  # first layout has TP=1: the single-process reference
            ref_results = reference_results(arch, ref, state.tp_group)
            micro_batches = _flow_grpo_batches(megatron_from_reference(ref, arch, state.tp_group), arch)
        key = (tp, cp, pp, vpp, layout)
        if key in PARITY:
            results[("parity", key)] = _parity(arch, ref, state, ref_results, layout)
        if key in TRAIN:
            results[("train", key)] = _train(arch, ref, state, micro_batches)
            if key == TRAIN[0]:  # the PP=1 baseline of the interleaved run's micro-batches
                results[("train-fixed", key)] = _train(arch, ref, state, micro_batches, "fixed")
        destroy_parallel(keep_default_group=True)
    dist.destroy_process_group()
    return results


def test_pipeline_parity_and_flow_grpo_losses_4_ranks():
    per_rank = run_distributed(_pp_worker, world_size=4, timeout_s=900)
    for key in PARITY:
        fwd = max(max(r[("parity", key)][0]) for r in per_rank)
        name, err = max(((n, e) for r in per_rank for n, e in r[("parity", key)][1].items()), key=lambda x: x[1])
        print(f"tp,cp,pp,vpp,layout={key}: forward rel err {fwd:.2e}, worst grad {name} {err:.2e}")
        assert fwd <= TOL and err <= TOL, (key, fwd, name, err)
    print("PP=1 losses per step (per micro-batch):", per_rank[0][("train", TRAIN[0])][0])
    for key in TRAIN[1:]:
        base_losses, base_logp, _ = per_rank[0][("train-fixed" if key[3] else "train", TRAIN[0])]
        base = torch.tensor(base_losses, dtype=torch.float64)
        for rank, r in enumerate(per_rank):
            losses, logp, spread = r[("train", key)]
            loss_err = ((torch.tensor(losses, dtype=torch.float64) - base).abs() / base.abs().clamp_min(1e-12)).max()
            logp_err = rel_err(logp, base_logp)
            if rank == 0:
                print(f"tp,cp,pp,vpp={key[:4]}: max loss rel diff {loss_err:.2e}, log-prob rel err {logp_err:.2e}, "
                      f"embedder spread over PP {spread:.1e}")
            pure_pp = key[0] == key[1] == 1
            assert loss_err <= (LOSS_TOL if pure_pp else MIXED_LOSS_TOL), (key, rank, losses, base_losses)
            assert logp_err <= (TOL if pure_pp else MIXED_LOGP_TOL), (key, rank, logp_err)
            assert spread == 0.0, (key, rank, spread)
