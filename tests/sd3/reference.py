"""Shared helpers of the SD3 tests: diffusers' SD3Transformer2DModel at random init, inputs in both layouts, and
our Megatron model loaded from the reference's weights through the mapping table."""
from __future__ import annotations

import torch

from checkpoints_convert.convert import mcore_state_from_hf
from model_specs.sd3.conditioning import pack, unpack
from model_specs.sd3.config import SD3Config, tiny_config
from model_specs.sd3.model import SD3Model
from model_specs.sd3.spec import sd3_block_spec
from tests.qwen_image_reference import rel_err

SHAPES = {"3.5-M": {}, "3.5-L": {"dual_attention_layers": ()}}  # tiny_config overrides per shape


def diffusers_reference(arch: SD3Config, seed: int = 0, dtype=torch.float32):
    """diffusers SD3Transformer2DModel with every parameter random (norm weights around 1, biases non-zero,
    matrices at std 1/sqrt(fan_in)), so that a wrongly mapped tensor cannot hide behind its init."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    model = SD3Transformer2DModel(**{k: v for k, v in arch.to_diffusers().items() if not k.startswith("_")})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm_q" in name or "norm_k" in name or "norm_added" in name:
                p.uniform_(0.5, 1.5)
            elif p.dim() >= 2:
                p.normal_(0.0, p[0].numel() ** -0.5)
            else:
                p.normal_(0.0, 0.05)
    return model.to(dtype).eval()


def make_inputs(arch: SD3Config, batch: int, text_len: int, grid_hw: tuple[int, int], seed: int = 1):
    """Random latent tokens [B, h * w, p^2 C] (packed), text embeddings, pooled embeddings and sigmas."""
    g = torch.Generator().manual_seed(seed)
    p = arch.patch_size
    latent = torch.randn(batch, arch.in_channels, grid_hw[0] * p, grid_hw[1] * p, generator=g)
    txt = torch.randn(batch, text_len, arch.joint_attention_dim, generator=g)
    pooled = torch.randn(batch, arch.pooled_projection_dim, generator=g)
    sigma = torch.rand(batch, generator=g)
    return pack(latent, p), txt, pooled, sigma


def reference_forward(ref, arch: SD3Config, img_BIC, txt, pooled, sigma, grid_hw):
    """diffusers on the unpacked latent (timestep 1000 sigma), its output packed back to tokens."""
    latent = unpack(img_BIC, *grid_hw, arch.patch_size)
    out = ref(hidden_states=latent, encoder_hidden_states=txt, pooled_projections=pooled,
              timestep=sigma * 1000.0).sample
    return pack(out, arch.patch_size)


def megatron_from_reference(ref, arch: SD3Config, tp_group, dtype=torch.float32, backend: str = "local") -> SD3Model:
    tp_rank, tp_size = tp_group.rank(), tp_group.size()
    config = arch.transformer_config(tp_size, params_dtype=dtype, perform_initialization=False)
    model = SD3Model(arch, config, tp_group, sd3_block_spec(backend, arch.qk_norm is not None))
    hf = ref.state_dict()
    result = model.load_state_dict(mcore_state_from_hf(arch, hf.__getitem__, tp_rank, tp_size), strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    return model.to(dtype)


__all__ = ["SHAPES", "tiny_config", "diffusers_reference", "make_inputs", "reference_forward",
           "megatron_from_reference", "rel_err"]
