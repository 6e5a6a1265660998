"""2x2 packing of latent (or pixel) grids into tokens, the order diffusers' Qwen-Image / Flux pipelines use."""
import torch


def pack_2x2(img_BCHW: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]."""
    b, c, h, w = img_BCHW.shape
    x = img_BCHW.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(tokens_BIC: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_2x2`: [B, (H/2)(W/2), 4C] -> [B, C, H, W]."""
    b, _, c4 = tokens_BIC.shape
    c = c4 // 4
    x = tokens_BIC.view(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, height, width)
