"""SD3 through the generic rollout and sync paths: the exporter walks SD3's per-block rules (dual-attention and
context_pre_only blocks) and the position-table buffer to exactly diffusers' state-dict names and values; the
embedded engine loads them (buffer included) and passes the pooled text, from a request or from the encoder's
text extras, to the denoiser."""
import pytest
import torch

from megatron_omni.rollout.engine import EmbeddedEngine, Request
from megatron_omni.sync import HFExporter, engine_side
from model_specs.sd3.config import tiny_config
from model_specs.sd3.model import SD3Model
from model_specs.sd3.spec import sd3_block_spec
from tests.sd3.reference import diffusers_reference, megatron_from_reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")
T, GRID = 5, (1, 2, 4)


def _fresh(arch, tp_group, seed: int) -> SD3Model:
    torch.manual_seed(seed)
    return SD3Model(arch, arch.transformer_config(1), tp_group, sd3_block_spec("local", arch.qk_norm is not None))


def test_export_load_and_pooled_text_through_the_engine(single_rank):
    arch = tiny_config()
    ref = diffusers_reference(arch)
    policy = megatron_from_reference(ref, arch, single_rank.tp_group)
    exported = dict(HFExporter(policy, single_rank.tp_group, mode="full").tensors())
    hf = ref.state_dict()
    assert exported.keys() == hf.keys() and "pos_embed.pos_embed" in exported
    assert all(torch.equal(exported[n], hf[n]) for n in hf)

    g = torch.Generator().manual_seed(3)
    emb, pooled = torch.randn(2, T, arch.joint_attention_dim, generator=g), torch.randn(2, arch.pooled_projection_dim,
                                                                                          generator=g)
    prompts = ["a", "b"]

    def encode(texts):  # the SD3 pipeline parts' form: (emb, mask, extras)
        rows = [prompts.index(t) for t in texts]
        return emb[rows], torch.ones(len(rows), T, dtype=torch.bool), {"pooled_BP": pooled[rows]}

    engine = EmbeddedEngine(_fresh(arch, single_rank.tp_group, seed=9), arch, encode)
    engine.model.pos_embed.zero_()  # the buffer must arrive with the weights
    assert "pos_embed.pos_embed" in engine.weight_views()
    engine.load_weights(exported.items())
    held = engine_side.held(engine, "full")
    assert all(torch.equal(held[n], hf[n]) for n in hf)

    common = dict(img_fhw=GRID, num_steps=3, sampler="ode", seed=5)
    by_prompt = engine.generate([Request(prompt=p, **common) for p in prompts])
    by_emb = engine.generate([Request(prompt_emb=emb[i], prompt_extras={"pooled_BP": pooled[i]}, **common)
                              for i in range(2)])
    other = engine.generate([Request(prompt_emb=emb[0], prompt_extras={"pooled_BP": pooled[1]}, **common)])
    assert all(torch.equal(a.latents, b.latents) for a, b in zip(by_prompt, by_emb))
    assert not torch.allclose(other[0].latents[-1], by_emb[0].latents[-1])  # the pooled text conditions
    # the engine's first velocity is the policy's (= diffusers') own forward with that pooled text
    x0 = by_emb[0].latents[0][None]
    with torch.no_grad():
        v = policy(x0, emb[:1], by_emb[0].sigmas[:1], GRID, None, pooled[:1])
    step = by_emb[0].sigmas[1] - by_emb[0].sigmas[0]
    assert torch.allclose(by_emb[0].latents[1], x0[0] + step * v[0], atol=1e-5)
    # a request without the pooled text batches apart (its extras are part of the batch key) and is refused
    with pytest.raises(ValueError, match="pooled text embeddings None; expected pooled_BP"):
        engine.generate([Request(prompt_emb=emb[0], **common)])
