"""Full-size SD3.5-Medium and SD3.5-Large build on the meta device with exactly diffusers' parameter counts; the
config rules refuse what the port does not implement."""
import pytest
import torch

from model_specs.sd3.config import SD3Config, sd35_large, sd35_medium, tiny_config
from model_specs.sd3.model import SD3Model
from model_specs.sd3.spec import sd3_block_spec

# the published transformer/config.json values (stabilityai/stable-diffusion-3.5-{medium,large})
PUBLISHED = {
    "3.5-medium": dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                       num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                       pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                       dual_attention_layers=list(range(13)), qk_norm="rms_norm"),
    "3.5-large": dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                      num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                      pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, dual_attention_layers=[],
                      qk_norm="rms_norm"),
}
OURS = {"3.5-medium": sd35_medium, "3.5-large": sd35_large}
PARAMS = {"3.5-medium": 2_243_171_520, "3.5-large": 8_056_627_520}  # diffusers on meta, counted 2026-12-01


@pytest.mark.parametrize("name", PUBLISHED)
def test_full_size_builds_on_meta_with_diffusers_parameter_count(single_rank, name):
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        ref = SD3Transformer2DModel(**PUBLISHED[name])
    arch = OURS[name]()
    assert {k: v for k, v in arch.to_diffusers().items() if not k.startswith("_")} == PUBLISHED[name]
    config = arch.transformer_config(1, params_dtype=torch.bfloat16, perform_initialization=False)
    with torch.device("meta"):
        model = SD3Model(arch, config, single_rank.tp_group, sd3_block_spec("local", qk_norm=True))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    ours, theirs = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in ref.parameters())
    print(f"SD{name}: ours {ours:,} parameters, diffusers {theirs:,}")
    assert ours == theirs == PARAMS[name]
    assert tuple(model.pos_embed.shape) == tuple(ref.pos_embed.pos_embed.shape)


@pytest.mark.parametrize("overrides,message", [
    ({"num_attention_heads": 5, "caption_projection_dim": 80}, "tensor-parallel size 2 does not divide "
                                                               "num_attention_heads=5"),
    ({"caption_projection_dim": 32}, "caption_projection_dim=32 must equal the hidden size"),
    ({"qk_norm": "layer_norm"}, "qk_norm='layer_norm' is not supported"),
    ({"dual_attention_layers": (3,)}, r"dual_attention_layers \[3\] are not block indices"),
    ({"pos_embed_max_size": None}, "pos_embed_max_size=None"),
])
def test_unsupported_architectures_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides).validate(tp=2)


def test_config_json_round_trip_and_refusals():
    cfg = {"_class_name": "SD3Transformer2DModel", "_diffusers_version": "0.31.0", **PUBLISHED["3.5-medium"]}
    arch = SD3Config.from_diffusers(cfg)
    assert arch == sd35_medium()
    assert {k: v for k, v in arch.to_diffusers().items() if not k.startswith("_")} == PUBLISHED["3.5-medium"]
    with pytest.raises(ValueError, match="is for 'FluxTransformer2DModel'; expected 'SD3Transformer2DModel'"):
        SD3Config.from_diffusers({**cfg, "_class_name": "FluxTransformer2DModel"})
    with pytest.raises(ValueError, match=r"keys \['num_single_layers'\] unknown to SD3Transformer2DModel"):
        SD3Config.from_diffusers({**cfg, "num_single_layers": 2})
