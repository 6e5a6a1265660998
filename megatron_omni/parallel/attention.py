"""Core attention for joint (text + image/video) DiT attention, in Megatron's [s, b, ...] layout.

This is the single-device core: PyTorch SDPA over the whole joint sequence.  The context-parallel
(USP: Ulysses x ring) variant is ``megatron_omni.parallel.usp.USPJointCoreAttention``; model code only
sees ``forward(q, k, v, mask, text_len)`` and picks one by its ``cp_groups``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class JointSDPACoreAttention(torch.nn.Module):
    """softmax(q k^T / sqrt(D) + mask) v for q, k, v of shape [S, B, N, D]; returns [S, B, N*D].

    The mask is boolean [B, 1, 1, S] (True = attend) or None.  Without a mask SDPA may choose the
    flash kernel; with one it uses cuDNN / memory-efficient attention (flash refuses boolean masks).
    """

    def __init__(self, cp_groups=None):
        super().__init__()
        if cp_groups is not None and cp_groups.cp > 1:
            raise ValueError(f"JointSDPACoreAttention attends over the whole sequence; with context-parallel "
                             f"size {cp_groups.cp} use megatron_omni.parallel.usp.USPJointCoreAttention")

    def forward(self, q_SBND: torch.Tensor, k_SBND: torch.Tensor, v_SBND: torch.Tensor,
                attn_mask_B11S: torch.Tensor | None = None, text_len: int = 0) -> torch.Tensor:
        q_BNSD, k_BNSD, v_BNSD = (t.permute(1, 2, 0, 3) for t in (q_SBND, k_SBND, v_SBND))
        out_BNSD = F.scaled_dot_product_attention(q_BNSD, k_BNSD, v_BNSD, attn_mask=attn_mask_B11S)
        s, b, n, d = q_SBND.shape
        # contiguous [S, B, N*D]: SDPA writes its output in q's layout, so for contiguous [S, B, N, D] q (both the
        # model's paths) this is a view.  A strided view of batch-major memory cannot fold into one GEMM: torch.matmul
        # then ran the image stream's output projection as a bmm over a broadcast weight (126 ms of a 1045 ms LoRA
        # rollout forward on an H200), hence the copy for other layouts
        return out_BNSD.permute(2, 0, 1, 3).contiguous().view(s, b, n * d)
