"""Parameter-free conditioning of the SD3 MMDiT: timestep sinusoids, the 2-D sincos position table and its
centred crop, latent patch packing and the joint text mask.

The values mirror diffusers' ``embeddings.py`` (``get_timestep_embedding`` as ``Timesteps(256,
flip_sin_to_cos=True, downscale_freq_shift=0)``, ``get_2d_sincos_pos_embed`` and ``PatchEmbed.cropped_pos_embed``).
Shape legend: B batch, C channels, H / W latent height / width, h / w the token grid (H / patch, W / patch),
M the position table's side (``pos_embed_max_size``), D hidden size, T text tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TIME_PROJ_DIM = 256  # diffusers Timesteps(num_channels=256)
TIMESTEP_SCALE = 1000.0  # SD3 takes t = 1000 sigma


@dataclass
class SD3Conditioning:
    """What every block needs besides the hidden states; travels explicitly.

    temb_BD:        timestep + pooled-text embedding [B, D] (input of every adaLN modulation).
    attn_mask_B11S: bool [B, 1, 1, T + I], True = attend, for the joint attention; None when no text token is
                    padding (diffusers' SD3 attends to every token: its pipeline passes no mask).
    text_len:       T; the joint hidden state is cat([text, image]) along the sequence.
    """

    temb_BD: torch.Tensor
    attn_mask_B11S: torch.Tensor | None
    text_len: int


def timestep_sinusoid(sigma_B: torch.Tensor, dim: int = TIME_PROJ_DIM) -> torch.Tensor:
    """[B] sigmas in [0, 1] -> [B, dim] float32 sinusoids of t = 1000 sigma, cos first (``flip_sin_to_cos``).

    t is formed first (float32) and then multiplied by the frequencies, the order in which diffusers sees the
    pipeline's ``timestep``: arguments reach 1000 rad, where a different rounding order moves sin by ~1e-4.
    """
    half = dim // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=sigma_B.device) / half
    args_BF = (sigma_B.float() * TIMESTEP_SCALE)[:, None] * torch.exp(exponent)[None, :]
    return torch.cat([torch.cos(args_BF), torch.sin(args_BF)], dim=-1)


def _sincos_1d(dim: int, pos: torch.Tensor) -> torch.Tensor:
    """[N] positions -> [N, dim] float64 (sin half, then cos half), frequencies 10000^(-2k/dim)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    angles = torch.outer(pos.reshape(-1).double(), omega)
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


def position_table(hidden: int, max_size: int, base_size: int) -> torch.Tensor:
    """The full [M * M, D] float32 sincos table (row-major over (row, column)), as ``PatchEmbed`` registers it.

    Positions are index / (M / base_size): a grid of ``base_size`` tokens per side spans [0, base_size).  The first
    half of D encodes the column, the second half the row (diffusers' meshgrid ``indexing="xy"`` order).
    """
    coords = torch.arange(max_size, dtype=torch.float32) / (max_size / base_size)
    rows_MM, cols_MM = torch.meshgrid(coords, coords, indexing="ij")
    return torch.cat([_sincos_1d(hidden // 2, cols_MM), _sincos_1d(hidden // 2, rows_MM)], dim=1).float()


def crop_positions(table_1ND: torch.Tensor, max_size: int, height: int, width: int) -> torch.Tensor:
    """The centred (height x width) window of the [1, M * M, D] table, [height * width, D] row-major."""
    if height > max_size or width > max_size:
        raise ValueError(f"image token grid {height} x {width} exceeds pos_embed_max_size={max_size}; expected at "
                         f"most {max_size} tokens per side ({max_size} x patch_size latent pixels)")
    top, left = (max_size - height) // 2, (max_size - width) // 2
    grid_MMD = table_1ND.view(max_size, max_size, -1)
    return grid_MMD[top:top + height, left:left + width].reshape(height * width, -1)


def pack(latent_BCHW: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, h * w, patch^2 * C] tokens, channels ordered (patch row, patch column, C): the order in
    which ``SD3Transformer2DModel`` unpatchifies its output, so a velocity token has its latent token's layout."""
    b, c, height, width = latent_BCHW.shape
    h, w = height // patch, width // patch
    x = latent_BCHW.reshape(b, c, h, patch, w, patch).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, h * w, patch * patch * c)


def unpack(tokens_BIC: torch.Tensor, h: int, w: int, patch: int) -> torch.Tensor:
    """Inverse of :func:`pack`: [B, h * w, patch^2 * C] -> [B, C, h * patch, w * patch]."""
    b, _, pc = tokens_BIC.shape
    c = pc // (patch * patch)
    x = tokens_BIC.reshape(b, h, w, patch, patch, c).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, c, h * patch, w * patch)


def joint_attention_mask(text_mask_BT: torch.Tensor | None, image_len: int) -> torch.Tensor | None:
    """[B, 1, 1, T + I] bool key mask over [text; image] (image keys always visible), or None for no padding."""
    if text_mask_BT is None:
        return None
    ones = torch.ones(text_mask_BT.shape[0], image_len, dtype=torch.bool, device=text_mask_BT.device)
    return torch.cat([text_mask_BT.bool(), ones], dim=1)[:, None, None, :]
