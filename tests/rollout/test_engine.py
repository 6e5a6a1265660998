"""EmbeddedEngine on the tiny Qwen-Image model at random init: batching invariance, the submit() queue,
prompt caching, request validation, and load_weights through the HF <-> Megatron mapping table."""
import random
from dataclasses import replace
import zlib

import pytest
import torch

from checkpoints_convert.convert import mcore_state_from_hf
from megatron_omni.rollout.engine import EmbeddedEngine, EngineConfig, Request, _WeightStager
from checkpoints_convert.qwen_image import qwen_image_rules
from tests.qwen_image_reference import diffusers_reference, megatron_from_reference, tiny_config

ARCH = tiny_config()
FHW = (1, 4, 4)


class ToyEncoder:
    """A deterministic stand-in for the text encoder: 2 + (number of words) tokens per prompt, each prompt's
    embeddings drawn from a generator seeded by its text; right-padded to the longest, with a mask."""

    def __init__(self):
        self.calls: list[list[str]] = []

    def __call__(self, texts):
        self.calls.append(list(texts))
        lens = [2 + len(t.split()) for t in texts]
        emb = torch.zeros(len(texts), max(lens), ARCH.joint_attention_dim)
        mask = torch.zeros(len(texts), max(lens), dtype=torch.bool)
        for i, (text, n) in enumerate(zip(texts, lens)):
            emb[i, :n] = torch.randn(n, ARCH.joint_attention_dim, generator=torch.Generator().manual_seed(
                zlib.crc32(text.encode())))
            mask[i, :n] = True
        return emb, mask


@pytest.fixture(scope="module")
def reference():
    return diffusers_reference(ARCH)


@pytest.fixture(scope="module")
def model(single_rank, reference):
    return megatron_from_reference(reference, ARCH, single_rank.tp_group)


PAD = 16  # text_pad_multiple of the batching tests: every prompt and negative prompt padded to one length (masked),
# so that requests of different prompts share a batch and cond / uncond rows a forward


def _requests():
    common = dict(img_fhw=FHW, num_steps=4, shift=2.0, noise_level=1.2, guidance_scale=4.0, window_size=2,
                  window_range=(0, 2))
    reqs = [Request(prompt=p, prompt_id=i, seed=100 + i, **common)
            for i, p in enumerate(["a red cat", "two dogs on a beach at night", "a red cat", "a blue house"])]
    reqs.append(Request(prompt="a red cat", prompt_id=4, seed=7, **{**common, "guidance_scale": 1.0}))  # no CFG
    reqs.append(Request(prompt="a tree", prompt_id=5, seed=8, img_fhw=(1, 2, 6), num_steps=4, sampler="cps",
                        noise_level=0.5, log_prob_form="simple"))
    return reqs


def _forward_batches(model):
    sizes = []
    handle = model.register_forward_hook(lambda m, args, out: sizes.append(args[0].shape[0]))
    return sizes, handle


def _assert_same(a, b):
    assert a.request is b.request and a.window_start == b.window_start
    for name in ("latents", "sigmas", "log_probs", "trained"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.numerics
def test_batched_and_one_by_one_rollouts_agree(model):
    """Batching changes no random number, padding or window (per-request generators, per-request text
    buckets).  What remains is the CPU BLAS: here its sgemm rows are bit-identical for any M >= 4 rows, but
    the [B, H] conditioning linears (timestep MLP, adaLN) of a forward with B < 4 rows take another
    kernel and differ in the last bit.  So: within float32 rounding (measured max |Δ| 9e-5 on latents up
    to 26, log-probs equal) for 1-2 rows, and between batchings of >= 4 rows (next test)."""
    encoder = ToyEncoder()
    engine = EmbeddedEngine(model, ARCH, encoder, EngineConfig(max_num_seqs=8, text_pad_multiple=PAD))
    reqs = _requests()
    sizes, handle = _forward_batches(model)
    batched = engine.generate(reqs)
    handle.remove()
    # three keys: 4 CFG requests (8 rows), 1 without CFG, 1 CPS; 4 steps each
    assert sorted(sizes) == sorted([8] * 4 + [1] * 4 + [1] * 4)
    assert len(encoder.calls) == 1 and sorted(encoder.calls[0]) == sorted(
        ["a red cat", "two dogs on a beach at night", "a blue house", "", "a tree"])  # cached per string
    for req, traj in zip(reqs, batched):
        one = engine.generate([req])[0]
        assert one.window_start == traj.window_start and torch.equal(one.trained, traj.trained)
        torch.testing.assert_close(one.latents, traj.latents, rtol=1e-5, atol=2e-4)
        torch.testing.assert_close(one.log_probs, traj.log_probs, rtol=1e-5, atol=1e-5)
    assert len(encoder.calls) == 1
    t0 = batched[0]
    assert t0.latents.shape == (5, 16, ARCH.in_channels) and t0.latents.dtype == torch.float32
    assert torch.equal(t0.final_sample, t0.latents[-1]) and t0.trained.sum() == 2
    assert torch.all(t0.log_probs[~t0.trained] == 0) and torch.all(t0.log_probs[t0.trained] != 0)
    assert not torch.equal(batched[0].latents, batched[2].latents)  # same prompt, other seed


def test_noise_drawn_before_the_first_step_is_the_step_by_step_noise(model, monkeypatch):
    """A batch's SDE noise drawn before its first denoising step (samplers.drawn_noise) or, over PREFETCH_BYTES,
    step by step.  Same requests, same kernels: the trajectories are bit-equal."""
    from megatron_omni.rollout import samplers

    reqs = _requests()  # SDE and CPS windows, a request without CFG
    monkeypatch.setattr(samplers, "PREFETCH_BYTES", 1 << 30)
    drawn = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(max_num_seqs=8)).generate(reqs)
    monkeypatch.setattr(samplers, "PREFETCH_BYTES", 0)
    stepwise = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(max_num_seqs=8)).generate(reqs)
    for a, b in zip(drawn, stepwise):
        _assert_same(a, b)
    assert any(bool(t.trained.any()) for t in drawn)


@pytest.mark.numerics
def test_batch_composition_is_invariant_at_four_rows_or_more(model):
    """8 rows vs 2 x 4 rows, requests in the other order.  On the machines measured (AMD EPYC, an AVX-512 Xeon) the
    trajectories are bitwise equal; that is a property of the CPU's BLAS, not of the engine (another CPU or BLAS
    may block 4 and 8 rows otherwise), so only what the engine decides is asserted exactly (windows, trained steps)
    and the float32 samples within the rounding bound of the 1-2 row test above.  A request that drew another
    request's noise, took its text or window moves its latents by O(1)."""
    reqs = [r for r in _requests() if r.guidance_scale > 1]  # 4 CFG requests
    whole = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(max_num_seqs=4, text_pad_multiple=PAD)).generate(
        reqs)  # 8 rows
    pairs = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(max_num_seqs=2, text_pad_multiple=PAD)).generate(
        reqs[::-1])  # 4 rows
    bitwise = True
    for a, b in zip(whole, pairs[::-1]):
        assert a.request is b.request and a.window_start == b.window_start
        assert torch.equal(a.sigmas, b.sigmas) and torch.equal(a.trained, b.trained)
        torch.testing.assert_close(a.latents, b.latents, rtol=1e-5, atol=2e-4)
        torch.testing.assert_close(a.log_probs, b.log_probs, rtol=1e-5, atol=1e-5)
        bitwise &= torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    print(f"8 rows vs 4 rows: bitwise equal {bitwise}")


@pytest.mark.numerics
def test_default_layout_runs_each_text_branch_unpadded_and_unmasked(model):
    """text_pad_multiple=1 (the default): real tokens only.  A request's prompt and negative prompt differ in
    length, so its cond and uncond rows run as two forwards, neither masked; requests share a batch only with
    prompts of their length; the samples equal those of the padded, masked joint forward to float32 rounding."""
    reqs = [r for r in _requests() if r.guidance_scale > 1]
    calls = []
    handle = model.register_forward_hook(lambda m, args, out: calls.append((args[0].shape[0], args[1].shape[1],
                                                                            args[4] is None)))
    got = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(max_num_seqs=8)).generate(reqs)
    handle.remove()
    # batches: "a red cat" x2 + "a blue house" (5 tokens), "two dogs on a beach at night" (9); negative "" (2)
    assert sorted(calls) == sorted([(3, 5, True)] * 4 + [(3, 2, True)] * 4 + [(1, 9, True)] * 4 + [(1, 2, True)] * 4)
    padded = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(max_num_seqs=8, text_pad_multiple=PAD)).generate(
        reqs)
    for a, b in zip(got, padded):
        torch.testing.assert_close(a.latents, b.latents, rtol=1e-5, atol=2e-4)
        torch.testing.assert_close(a.log_probs, b.log_probs, rtol=1e-5, atol=1e-5)


def test_max_num_seqs_splits_batches_and_submit_fills_them(model):
    reqs = [r for r in _requests() if r.guidance_scale > 1]
    engine = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(max_num_seqs=3, wait_ms=1000,
                                                                    text_pad_multiple=PAD))
    expected = engine.generate(reqs)
    sizes, handle = _forward_batches(model)
    futures = [engine.submit(r) for r in reqs]  # the first 3 run as soon as they are queued, the 4th after 1 s
    got = [f.result(timeout=60) for f in futures]
    engine.close()
    handle.remove()
    assert sizes == [6] * 4 + [2] * 4  # CFG doubles the rows
    for a, b in zip(got, expected):
        _assert_same(a, b)


@pytest.mark.parametrize("change, match", [
    (dict(sampler="euler"), "sampler='euler'"),
    (dict(noise_level=0.0), "noise_level=0.0"),
    (dict(window_size=2, window_range=(0, 3)), r"start range \(0, 3\)"),
    (dict(window_size=2, window_start=3), "start=3"),
    (dict(sampler="cps", noise_level=0.5), "CPS's last step"),
    (dict(log_prob_form="simple"), "log_prob_form='simple'"),
    (dict(cfg_rescale="channel"), "cfg_rescale='channel'"),
    (dict(img_fhw=(1, 0, 4)), "img_fhw"),
    (dict(prompt_emb=torch.zeros(3, 5)), r"prompt_emb has shape \(3, 5\)"),
])
def test_bad_requests_are_refused_naming_the_field(model, change, match):
    engine = EmbeddedEngine(model, ARCH, ToyEncoder())
    with pytest.raises(ValueError, match=match):
        engine.generate([Request(prompt="x", **{"img_fhw": FHW, "num_steps": 4, **change})])


def test_prompt_embeddings_given_directly_match_the_encoder_path(model):
    emb, mask = ToyEncoder()(["a red cat", ""])
    direct = Request(prompt_emb=emb[0], prompt_mask=mask[0], negative_prompt_emb=emb[1, :2], img_fhw=FHW,
                     num_steps=3, guidance_scale=3.0, seed=1)
    by_text = Request(prompt="a red cat", img_fhw=FHW, num_steps=3, guidance_scale=3.0, seed=1)
    a = EmbeddedEngine(model, ARCH).generate([direct])[0]  # no encoder needed
    b = EmbeddedEngine(model, ARCH, ToyEncoder()).generate([by_text])[0]
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    with pytest.raises(ValueError, match="no encode_prompts"):
        EmbeddedEngine(model, ARCH).generate([by_text])


def _context(seed, frames=1, fhw=FHW):
    return torch.randn(frames * fhw[1] * fhw[2], ARCH.in_channels, generator=torch.Generator().manual_seed(seed))


@pytest.mark.numerics
def test_context_latents_join_every_forward_as_their_own_frames(model):
    """An edit's source tokens: each forward runs on [x; context] at img_fhw (1 + frames, h, w) and keeps the
    first S_I outputs; a batch of context requests equals each alone; without context nothing changes."""
    common = dict(img_fhw=FHW, num_steps=3, noise_level=1.0, guidance_scale=3.0, window_size=2)
    reqs = [Request(prompt=p, prompt_id=i, seed=20 + i, context_latents=_context(i), **common)
            for i, p in enumerate(["a red cat", "a blue house"])]
    engine = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(text_pad_multiple=PAD))
    grids, handle = [], model.register_forward_hook(lambda m, args, out: grids.append((args[0].shape, args[3])))
    try:
        batched = engine.generate(reqs)
    finally:
        handle.remove()
    assert {g for g in grids} == {(torch.Size([4, 32, ARCH.in_channels]), (2, 4, 4))}  # cond + uncond rows
    for r, t in zip(reqs, batched):
        _assert_same(engine.generate([r])[0], t)
        assert t.latents.shape == (4, 16, ARCH.in_channels)

    # the velocity is the model's on [x; context] at the stacked grid, sliced: one ODE step by hand
    r = replace(reqs[0], sampler="ode", guidance_scale=1.0, window_size=None, num_steps=1, shift=1.0)
    traj = EmbeddedEngine(model, ARCH, ToyEncoder()).generate([r])[0]
    emb, _ = ToyEncoder()([r.prompt])
    with torch.no_grad():
        v = model(torch.cat([traj.latents[:1], r.context_latents[None]], dim=1), emb, torch.ones(1), (2, 4, 4))
    assert torch.allclose(traj.latents[1], traj.latents[0] - v[0, :16], atol=1e-6)
    plain = EmbeddedEngine(model, ARCH, ToyEncoder()).generate([replace(r, context_latents=None)])[0]
    assert not torch.allclose(plain.latents[1], traj.latents[1], atol=1e-3)  # the context does condition it


@pytest.mark.numerics
def test_training_microbatches_with_context_score_the_rollouts_log_probs(model):
    """Flow-GRPO micro-batches of context requests (text given as embeddings, as an edit's): the trainer's forward
    on [x_t; context] at the stacked grid, its first I tokens, gives back the rollout's log-probs."""
    from megatron_omni.algorithms.flow_grpo.microbatches import grpo_microbatches
    from megatron_omni.algorithms.flow_grpo.step import guided_velocity, model_output, step_log_prob

    emb, mask = ToyEncoder()(["a red cat", "a blue house", ""])
    reqs = [Request(prompt=f"edit {i}", prompt_id=i, prompt_emb=emb[i], prompt_mask=mask[i],
                    negative_prompt_emb=emb[2], negative_prompt_mask=mask[2], seed=30 + i, img_fhw=FHW, num_steps=4,
                    noise_level=1.0, guidance_scale=3.0, window_size=2, context_latents=_context(5 + i))
                for i in range(2)]
    trajs = EmbeddedEngine(model, ARCH).generate(reqs)
    mbs = grpo_microbatches(trajs, torch.zeros(2), {}, size=3)  # no text table: the requests' own embeddings
    assert all(mb.context.shape[1:] == (16, ARCH.in_channels) for mb in mbs)
    with torch.no_grad():
        for mb in mbs:
            _, log_prob, _ = step_log_prob(guided_velocity(model_output(model, mb), mb), mb)
            assert (log_prob - mb.old_log_prob).abs().max() <= 1e-6, (log_prob, mb.old_log_prob)
            joint = model_output(model, mb, joint=True)  # cond and uncond rows in one forward
            assert joint.shape == (2 * mb.x_t.shape[0], 32, ARCH.in_channels)
            assert (step_log_prob(guided_velocity(joint, mb), mb)[1] - mb.old_log_prob).abs().max() <= 1e-5
    stage = torch.nn.Linear(1, 1)
    stage.pre_process = False  # a pipeline stage (and a context-parallel model) refuses context tokens
    with pytest.raises(ValueError, match="pipeline- and context-parallel size 1"):
        model_output(stage, mbs[0])


def test_context_latents_that_are_not_whole_frames_are_refused(model):
    engine = EmbeddedEngine(model, ARCH, ToyEncoder())
    for bad in (torch.zeros(20, ARCH.in_channels), torch.zeros(16, ARCH.in_channels + 1), torch.zeros(16)):
        with pytest.raises(ValueError, match="context_latents has shape"):
            engine.generate([Request(prompt="x", img_fhw=FHW, num_steps=2, context_latents=bad)])


# ---- load_weights ----------------------------------------------------------------------------------
@pytest.fixture
def fresh_engine(single_rank):
    arch_cfg = ARCH.transformer_config(1)
    from model_specs.qwen_image.model import QwenImageModel
    return EmbeddedEngine(QwenImageModel(ARCH, arch_cfg, single_rank.tp_group), ARCH, ToyEncoder())


def _snapshot(engine):
    return {k: v.clone() for k, v in engine.model.named_parameters()}


def test_load_weights_round_trip_matches_mcore_state_from_hf(fresh_engine, reference, model):
    hf = reference.state_dict()
    items = list(hf.items())
    random.Random(0).shuffle(items)  # q, k, v arrive separately and in any order
    loaded = fresh_engine.load_weights(iter(items))
    expected = mcore_state_from_hf(ARCH, hf.__getitem__)
    assert loaded == set(expected)
    params = dict(fresh_engine.model.named_parameters())
    assert all(torch.equal(params[k], v) for k, v in expected.items())
    reqs = [Request(prompt="a red cat", img_fhw=FHW, num_steps=3, guidance_scale=4.0, seed=3)]
    a = fresh_engine.generate(reqs)[0]
    b = EmbeddedEngine(model, ARCH, ToyEncoder()).generate(reqs)[0]  # loaded via mcore_state_from_hf
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)


def test_load_weights_copies_what_it_receives(fresh_engine, reference):
    """A sender may reuse one buffer for every tensor (as bucketed weight sync does) once a pair is consumed."""
    hf = reference.state_dict()
    buffer = torch.empty(max(t.numel() for t in hf.values()))

    def through_one_buffer():
        for name, t in hf.items():
            view = buffer[:t.numel()].view(t.shape)
            view.copy_(t)
            yield name, view
            buffer.fill_(float("nan"))

    fresh_engine.load_weights(through_one_buffer())
    params = dict(fresh_engine.model.named_parameters())
    assert all(torch.equal(params[k], v) for k, v in mcore_state_from_hf(ARCH, hf.__getitem__).items())


def test_bad_weights_leave_the_model_untouched(fresh_engine, reference):
    hf = reference.state_dict()
    before = _snapshot(fresh_engine)
    bad = "transformer_blocks.1.attn.to_k.weight"
    cases = [
        ([(n, torch.zeros(3, 4) if n == bad else t) for n, t in hf.items()], f"{bad}.*shape \\(3, 4\\)"),
        ([*hf.items(), ("transformer_blocks.9.attn.to_q.weight", hf[bad])], "transformer_blocks.9.attn.to_q.weight"),
        ([*hf.items(), (bad, hf[bad])], "given twice"),
        ([(n, t) for n, t in hf.items() if n != "transformer_blocks.0.attn.add_v_proj.bias"], "add_v_proj.bias"),
        ([(n, t.long() if n == "img_in.weight" else t) for n, t in hf.items()], "img_in.weight"),
    ]
    for pairs, match in cases:
        with pytest.raises(ValueError, match=match):
            fresh_engine.load_weights(iter(pairs))
        after = _snapshot(fresh_engine)
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_fused_qkv_parts_are_buffered_only_until_complete(fresh_engine, reference):
    hf = reference.state_dict()
    params = dict(fresh_engine.model.named_parameters())
    stager = _WeightStager(qwen_image_rules(ARCH), params, ARCH.num_attention_heads, 0, 1)
    prefix = "transformer_blocks.0.attn."
    stager.add(prefix + "to_v.weight", hf[prefix + "to_v.weight"])
    stager.add(prefix + "to_q.weight", hf[prefix + "to_q.weight"])
    assert list(stager.waiting) == ["blocks.0.attention.linear_qkv.weight"] and not stager.staged
    stager.add(prefix + "to_k.weight", hf[prefix + "to_k.weight"])
    assert not stager.waiting and list(stager.staged) == ["blocks.0.attention.linear_qkv.weight"]
    stager.add("img_in.bias", hf["img_in.bias"])  # a plain tensor is staged at once
    assert not stager.waiting and "img_in.bias" in stager.staged


def test_sleep_and_wake_are_no_ops_on_cpu(model):
    engine = EmbeddedEngine(model, ARCH, ToyEncoder())
    engine.sleep()
    traj = engine.generate([Request(prompt="x", img_fhw=FHW, num_steps=2, seed=0)])[0]
    engine.wake()
    assert traj.latents.shape[0] == 3 and next(model.parameters()).device.type == "cpu"


@pytest.mark.numerics
def test_kept_uncond_velocity_is_the_one_the_rollout_combined(model):
    """keep_uncond_velocity: per trained step the uncond output, float32 [K, S_I, C]; with the cond output of
    the same step it reproduces the rollout's step (its log-prob); other requests keep nothing."""
    from megatron_omni.rollout.samplers import cfg_combine, gaussian_log_prob, sde_mean_std

    encoder = ToyEncoder()
    engine = EmbeddedEngine(model, ARCH, encoder, EngineConfig(max_num_seqs=8))
    reqs = [r for r in _requests() if r.guidance_scale > 1]
    kept = engine.generate([replace(r, keep_uncond_velocity=True) for r in reqs[:2]] + reqs[2:])
    plain = engine.generate(reqs)
    for tr, ref in zip(kept, plain):  # recording changes nothing of the rollout
        for name in ("latents", "log_probs", "trained"):
            assert torch.equal(getattr(tr, name), getattr(ref, name)), name
    assert all(tr.uncond_velocity is None for tr in kept[2:] + plain)
    for tr in kept[:2]:
        k = int(tr.trained.sum())
        assert tr.uncond_velocity.shape == (k, 16, ARCH.in_channels) and tr.uncond_velocity.dtype == torch.float32
        emb, mask = encoder([tr.request.prompt, ""])
        for slot, j in enumerate(torch.nonzero(tr.trained).flatten().tolist()):
            x = tr.latents[j:j + 1]
            t = tr.sigmas[j].expand(1)
            with torch.no_grad():
                v_c = model(x, emb[:1, :int(mask[0].sum())], t, FHW, None)
                v_u = model(x, emb[1:, :int(mask[1].sum())], t, FHW, None)
            torch.testing.assert_close(tr.uncond_velocity[slot], v_u[0].float(), rtol=1e-4, atol=1e-4)
            v = cfg_combine(v_c, tr.uncond_velocity[slot:slot + 1], tr.request.guidance_scale, tr.request.cfg_rescale)
            mean, std = sde_mean_std(x, v, t, tr.sigmas[j + 1].expand(1), tr.request.noise_level, tr.sigmas[1])
            torch.testing.assert_close(gaussian_log_prob(tr.latents[j + 1:j + 2], mean, std), tr.log_probs[j:j + 1],
                                       rtol=1e-5, atol=1e-4)
    no_cfg = engine.generate([replace(_requests()[4], keep_uncond_velocity=True)])[0]
    assert no_cfg.uncond_velocity is None  # no uncond branch without CFG


@pytest.mark.slow  # (a CPU compile: run once, natively, not again under the avx2 pass)
def test_compiled_batch_checks_its_guards_fully_only_at_its_first_step(single_rank, reference):
    """``skip_repeat_guards``: under torch.compile a batch's first denoising step runs with dynamo's full guard
    checks (compiling what it needs: here each text length's graphs), its later steps only with the guards that
    tell the graphs apart; the rollouts are bit-equal to full checks at every step, and the stance is the default
    again after the batch."""
    from torch._dynamo import eval_frame

    from megatron_omni.compile import compile_blocks

    torch._dynamo.reset()
    model = megatron_from_reference(reference, ARCH, single_rank.tp_group)
    compile_blocks(model, "default")
    skipping = []
    handle = model.register_forward_pre_hook(lambda m, args: skipping.append(eval_frame._stance.skip_guard_eval_unsafe))
    reqs = [r for r in _requests() if r.guidance_scale > 1][:2]  # CFG: the cond and the negative prompt apart
    runs = {}
    try:
        for skip in (True, False):  # the skipping run first: its first steps compile the graphs
            skipping.clear()
            engine = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(max_num_seqs=8, skip_repeat_guards=skip))
            runs[skip] = engine.generate(reqs)
            # two batches (two prompt lengths), each 4 steps x 2 forwards (cond, uncond: two text lengths)
            assert skipping == ([False] * 2 + [skip] * 6) * 2, skipping
            assert eval_frame._stance.skip_guard_eval_unsafe is False
    finally:
        handle.remove()
        torch._dynamo.reset()
    for a, b in zip(runs[True], runs[False]):
        _assert_same(a, b)
