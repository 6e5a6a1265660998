"""The full-size Qwen-Image builds on the meta device with exactly diffusers' parameter count."""
import math

import pytest
import torch

from checkpoints_convert.convert import expected_hf_shapes
from model_specs.qwen_image.config import QwenImageConfig
from model_specs.qwen_image.model import QwenImageModel
from model_specs.qwen_image.spec import qwen_image_block_spec

FULL_SIZE_PARAMS = 20_430_401_088  # diffusers QwenImageTransformer2DModel() on meta, counted 2026-11-30


def test_full_size_builds_on_meta_with_diffusers_parameter_count(single_rank):
    arch = QwenImageConfig()
    assert (arch.num_layers, arch.hidden_size, arch.num_attention_heads, arch.joint_attention_dim) == (60, 3072, 24, 3584)
    config = arch.transformer_config(1, params_dtype=torch.bfloat16, perform_initialization=False)
    with torch.device("meta"):
        model = QwenImageModel(arch, config, single_rank.tp_group, qwen_image_block_spec("local"))
    ours = sum(p.numel() for p in model.parameters())
    theirs = sum(math.prod(s) for s in expected_hf_shapes(arch).values())
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert ours == theirs == FULL_SIZE_PARAMS
    assert round(ours / 1e9, 2) == 20.43


@pytest.mark.parametrize("field,value,message", [
    ("num_attention_heads", 5, "tensor-parallel size 2 does not divide num_attention_heads=5"),
    ("axes_dims_rope", (8, 12, 10), "sums to 30; expected attention_head_dim=32"),
    ("zero_cond_t", True, "zero_cond_t=True is not supported"),
])
def test_unsupported_architectures_are_refused(field, value, message):
    from model_specs.qwen_image.config import tiny_config

    arch = tiny_config(**{field: value, "num_attention_heads": 5 if field == "num_attention_heads" else 4})
    with pytest.raises(ValueError, match=message):
        arch.validate(tp=2)
