"""Shared fixtures for Qwen-Image tests: the diffusers reference at random init, inputs, and our
Megatron model loaded from the reference's weights through the mapping table."""
from __future__ import annotations

import torch

from checkpoints_convert.convert import mcore_state_from_hf
from model_specs.qwen_image.config import QwenImageConfig, tiny_config
from model_specs.qwen_image.model import QwenImageModel
from model_specs.qwen_image.spec import qwen_image_block_spec


def diffusers_reference(arch: QwenImageConfig, seed: int = 0, dtype=torch.float32):
    """diffusers QwenImageTransformer2DModel with every parameter random: norm weights too (so a wrongly
    mapped norm weight cannot hide behind an all-ones init), biases non-zero, and matrices at std
    1/sqrt(fan_in) so activations keep their scale through the blocks as in a trained model (a larger
    std makes the network chaotic, and bf16 rounding then says nothing about the port)."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(**{k: v for k, v in arch.to_diffusers().items() if not k.startswith("_")})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            else:
                p.normal_(0.0, 0.05)
    return model.to(dtype).eval()


def make_inputs(arch: QwenImageConfig, batch: int, text_len: int, img_fhw: tuple[int, int, int],
                pad: list[int] | None = None, seed: int = 1, dtype=torch.float32):
    """Random packed image tokens, text embeddings, sigmas, and a text mask with ``pad[b]`` padding
    tokens at the end of sample b (None: no mask)."""
    g = torch.Generator().manual_seed(seed)
    n_img = img_fhw[0] * img_fhw[1] * img_fhw[2]
    img = torch.randn(batch, n_img, arch.in_channels, generator=g).to(dtype)
    txt = torch.randn(batch, text_len, arch.joint_attention_dim, generator=g).to(dtype)
    sigma = torch.rand(batch, generator=g)
    mask = None
    if pad is not None:
        mask = torch.ones(batch, text_len, dtype=torch.bool)
        for b, n in enumerate(pad):
            if n:
                mask[b, text_len - n:] = False
    return img, txt, sigma, mask


def reference_forward(ref, img, txt, sigma, img_fhw, mask):
    return ref(hidden_states=img, encoder_hidden_states=txt, encoder_hidden_states_mask=mask, timestep=sigma,
               img_shapes=[[tuple(img_fhw)]] * img.shape[0]).sample


def megatron_from_reference(ref, arch: QwenImageConfig, tp_group, dtype=torch.float32,
                            backend: str = "local") -> QwenImageModel:
    tp_rank, tp_size = tp_group.rank(), tp_group.size()
    config = arch.transformer_config(tp_size, params_dtype=dtype, perform_initialization=False)
    model = QwenImageModel(arch, config, tp_group, qwen_image_block_spec(backend))
    hf = ref.state_dict()
    result = model.load_state_dict(mcore_state_from_hf(arch, hf.__getitem__, tp_rank, tp_size), strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    return model.to(dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; ||a|| when b is exactly zero."""
    a, b = a.double(), b.double()
    denom = b.norm()
    return ((a - b).norm() / denom).item() if denom > 0 else a.norm().item()


__all__ = ["tiny_config", "diffusers_reference", "make_inputs", "reference_forward", "megatron_from_reference",
           "rel_err"]
