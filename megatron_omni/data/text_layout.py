"""How a row's text reaches the DiT: its real tokens only, zero-padded to a shared length, masked only if padded.

The rollout engine lays text out this way for every prompt (a request's prompt and negative prompt apart, each
rounded up to a multiple of ``EngineConfig.text_pad_multiple`` so that batching does not change shapes; with the
default multiple of 1, real tokens only and no mask), and the trainer lays out the rows it re-scores the same
way: the same sequence length and, where nothing is padded, no attention mask (with one, SDPA runs a masked
kernel: 1.6x the unmasked forward at the rollout's batch 32 on an H200, bench/attention_mask.py, and rounds
differently).  Legend: T tokens, E embedding width, L the shared padded length.
"""
from __future__ import annotations

import torch


def real_tokens(emb_TE: torch.Tensor, mask_T: torch.Tensor | None, prompt: str) -> torch.Tensor:
    """The real (unpadded) tokens of one prompt, [T_real, E], like diffusers' Qwen-Image pipeline keeps them."""
    if mask_T is not None:
        if tuple(mask_T.shape) != tuple(emb_TE.shape[:1]):
            raise ValueError(f"prompt {prompt!r}: mask has shape {tuple(mask_T.shape)}; expected [{emb_TE.shape[0]}]")
        emb_TE = emb_TE[mask_T.to(torch.bool)]
    if emb_TE.shape[0] == 0:
        raise ValueError(f"prompt {prompt!r} has no real token (its mask is all False)")
    return emb_TE.detach().clone()


def real_tokens_of(entries: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> dict[str, torch.Tensor]:
    """``real_tokens`` of many prompts ({prompt: (emb [T, E], mask [T] or None)}) with one read of their masks
    on the host (the boolean indexing of ``real_tokens`` reads each mask apart: a device sync per prompt); a mask
    whose real tokens are a prefix (right padding, as the text encoders pad) is a slice, no index on the device."""
    masked = [(p, emb, mask) for p, (emb, mask) in entries.items() if mask is not None]
    for p, emb, mask in masked:
        if tuple(mask.shape) != tuple(emb.shape[:1]):
            raise ValueError(f"prompt {p!r}: mask has shape {tuple(mask.shape)}; expected [{emb.shape[0]}]")
    host = torch.cat([m.reshape(-1).to(torch.bool) for _, _, m in masked]).cpu() if masked else None
    out, at = {}, 0
    for p, (emb, mask) in entries.items():
        if mask is None:
            out[p] = real_tokens(emb, None, p)
            continue
        m = host[at:at + mask.shape[0]]
        at += mask.shape[0]
        n = int(m.sum())
        out[p] = real_tokens(emb[:n], None, p) if bool(m[:n].all()) else real_tokens(emb, m.to(emb.device), p)
    return out


def padded_length(lengths, multiple: int) -> int:
    """The longest of ``lengths`` rounded up to a multiple of ``multiple``."""
    return -(-max(lengths) // multiple) * multiple


def pad_rows(parts: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([n, L, E] the parts zero-padded to ``length``, [n, L] bool mask True on real tokens or None when no part
    is padded)."""
    if any(p.shape[0] > length for p in parts):
        raise ValueError(f"text of {max(p.shape[0] for p in parts)} tokens does not fit the padded length {length}")
    txt = torch.stack([torch.cat([p, p.new_zeros(length - p.shape[0], p.shape[1])]) for p in parts])
    if all(p.shape[0] == length for p in parts):
        return txt, None
    return txt, torch.stack([torch.arange(length, device=txt.device) < p.shape[0] for p in parts])
