"""Conditioning of the Qwen-Image MMDiT: timestep sinusoids, 3-D RoPE tables and the joint text mask.

Everything here is parameter-free math; the learned conditioning embedders live in ``model.py``.
The values mirror diffusers' ``transformer_qwenimage.py`` (``get_timestep_embedding``,
``QwenEmbedRope`` with ``scale_rope=True``, the joint mask built in ``QwenDoubleStreamAttnProcessor2_0``).

Shape legend: B batch, S_T text tokens, S_I image tokens, S = S_T + S_I, D head dim, F/H/W the
frame / height / width of the packed image token grid (H, W are latent size / 2).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

TIME_PROJ_DIM = 256  # diffusers Timesteps(num_channels=256, flip_sin_to_cos=True, shift=0, scale=1000)
ROPE_TABLE_LEN = 4096  # positions precomputed by QwenEmbedRope (both signs)


@dataclass
class QwenImageConditioning:
    """What every block needs besides the hidden states; travels explicitly, never via attention_mask.

    temb_BH:       timestep embedding, [B, hidden] (input of every adaLN modulation); [1, hidden] from a
                   ModulationTable's step, broadcast over the batch.
    txt_freqs:     RoPE (cos, sin) for text tokens, float32 [S_T, D/2, 2].
    img_freqs:     RoPE (cos, sin) for image tokens, float32 [S_I, D/2, 2].
    attn_mask_B11S: bool, True = attend; None when no text token is padding (lets SDPA pick flash).
    text_len:      S_T; the joint hidden state is cat([text, image]) along the sequence.
    """

    temb_BH: torch.Tensor
    txt_freqs: torch.Tensor
    img_freqs: torch.Tensor
    attn_mask_B11S: torch.Tensor | None
    text_len: int


@dataclass
class ModulationTable:
    """Every adaLN modulation of a model at N timesteps, computed once (``QwenImageModel.modulation_table``).

    A modulation depends on the timestep alone, and a rollout evaluates the same N sigmas for every row of a
    batch: its forwards can read them here instead of running the blocks' modulation products at every step
    (at full size 120 GEMVs over 13.6 GB of weights, ~3.9 ms of a batch-8 forward on an H200).  No gradient
    flows through it, and it is stale once the weights change.

    temb_NH:   timestep embeddings [N, hidden].
    blocks:    global block index -> (image modulation [N, 6 hidden], text modulation [N, 6 hidden]).
    out_N2H:   the output norm's (scale, shift) [N, 2 hidden], or None on a stage without the head.
    """

    temb_NH: torch.Tensor
    blocks: dict[int, tuple[torch.Tensor, torch.Tensor]]
    out_N2H: torch.Tensor | None

    def step(self, n: int) -> "ModulationTable":
        """The table at timestep n alone (N = 1: what a forward takes; it broadcasts over the batch)."""
        if not 0 <= n < len(self.temb_NH):
            raise IndexError(f"timestep {n} is outside this modulation table of {len(self.temb_NH)} timesteps")
        row = slice(n, n + 1)
        return ModulationTable(self.temb_NH[row], {i: (img[row], txt[row]) for i, (img, txt) in self.blocks.items()},
                               None if self.out_N2H is None else self.out_N2H[row])


def timestep_sinusoid(sigma_B: torch.Tensor, dtype: torch.dtype = torch.float32, dim: int = TIME_PROJ_DIM,
                      scale: float = 1000.0) -> torch.Tensor:
    """[B] sigmas in [0, 1] -> [B, dim] float32 sinusoids, cos first (``flip_sin_to_cos=True``).

    ``dtype`` is the model's parameter dtype: diffusers rounds the sigmas to it (``timestep.to(
    hidden_states.dtype)``) before the float32 product, and a bf16 checkpoint was trained with that
    rounding, so we keep it.  The frequency table stays float32 (diffusers' ``Timesteps``).
    """
    half = dim // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=sigma_B.device) / half
    args_BF = sigma_B.to(dtype)[:, None].float() * torch.exp(exponent)[None, :] * scale
    return torch.cat([torch.cos(args_BF), torch.sin(args_BF)], dim=-1)


def _axis_freqs(index: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """Complex unit phasors index * theta^(-2k/dim), [len(index), dim/2]."""
    inv = 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float32).div(dim))
    angles = torch.outer(index, inv)
    return torch.polar(torch.ones_like(angles), angles)


@lru_cache(maxsize=8)
def _rope_tables(axes_dims: tuple[int, int, int], theta: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positive and negative position tables, each [ROPE_TABLE_LEN, D/2] complex64 (CPU, cached)."""
    pos = torch.arange(ROPE_TABLE_LEN)
    neg = torch.arange(ROPE_TABLE_LEN).flip(0) * -1 - 1
    pos_t = torch.cat([_axis_freqs(pos, d, theta) for d in axes_dims], dim=1)
    neg_t = torch.cat([_axis_freqs(neg, d, theta) for d in axes_dims], dim=1)
    return pos_t, neg_t


def rope_freqs(img_fhw: tuple[int, int, int], text_len: int, axes_dims: tuple[int, int, int],
               theta: int = 10000, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-Image 3-D RoPE (``scale_rope=True``): image positions centred on the grid, text after it.

    Returns (img_freqs [F*H*W, D/2, 2], txt_freqs [S_T, D/2, 2]): float32 (cos, sin) on ``device``,
    cached per shape and device, so a denoising loop builds them once and copies nothing per step.
    (Real rather than complex: torch.compile's inductor generates no code for complex tensors.)
    Height and width run from -(n - n//2) to n//2 - 1 so the grid is centred on 0; text tokens take
    positions max(H//2, W//2) ... on all three axes, i.e. just past the image's largest index.
    """
    return _rope_freqs(tuple(int(v) for v in img_fhw), int(text_len), tuple(axes_dims), theta, torch.device(device))


@lru_cache(maxsize=32)
def _rope_freqs(img_fhw, text_len, axes_dims, theta, device):
    frames, height, width = img_fhw
    if max(height, width, frames) > ROPE_TABLE_LEN or text_len + max(height // 2, width // 2) > ROPE_TABLE_LEN:
        raise ValueError(f"image grid {img_fhw} with {text_len} text tokens exceeds the RoPE table of "
                         f"{ROPE_TABLE_LEN} positions")
    pos_t, neg_t = _rope_tables(tuple(axes_dims), theta)
    split = [d // 2 for d in axes_dims]
    pos_f, pos_h, pos_w = pos_t.split(split, dim=1)
    _, neg_h, neg_w = neg_t.split(split, dim=1)
    f_FHWd = pos_f[:frames].view(frames, 1, 1, -1).expand(frames, height, width, -1)
    h_col = torch.cat([neg_h[-(height - height // 2):], pos_h[: height // 2]], dim=0)
    w_col = torch.cat([neg_w[-(width - width // 2):], pos_w[: width // 2]], dim=0)
    h_FHWd = h_col.view(1, height, 1, -1).expand(frames, height, width, -1)
    w_FHWd = w_col.view(1, 1, width, -1).expand(frames, height, width, -1)
    img = torch.cat([f_FHWd, h_FHWd, w_FHWd], dim=-1).reshape(frames * height * width, -1)
    start = max(height // 2, width // 2)
    txt = pos_t[start: start + text_len]
    return torch.view_as_real(img).to(device), torch.view_as_real(txt).to(device)


def joint_attention_mask(text_mask_BT: torch.Tensor | None, image_len: int) -> torch.Tensor | None:
    """[B, 1, 1, S_T + S_I] bool mask for joint attention (image tokens always visible).

    None when there is no text mask. A mask whose text tokens are all valid is still returned
    (checking would cost a host sync); callers that know there is no padding pass None.
    """
    if text_mask_BT is None:
        return None
    text_mask_BT = text_mask_BT.to(torch.bool)
    img_mask = torch.ones(text_mask_BT.shape[0], image_len, dtype=torch.bool, device=text_mask_BT.device)
    return torch.cat([text_mask_BT, img_mask], dim=1)[:, None, None, :]
