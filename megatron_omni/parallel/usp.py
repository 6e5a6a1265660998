"""USP core attention for joint (text + image/video) DiT attention: Ulysses x ring over the CP group.

Layout of the context-parallel group (cp = ulysses * ring), CP rank c = ring_rank * ulysses + ulysses_rank:
image tokens are split into cp equal chunks in sequence order and CP rank c holds chunk c; text tokens are
short and kept whole (replicated) on every CP rank.  Inside the core attention:

1. Ulysses: an all-to-all over the ulysses group trades the sequence split for a head split, so each rank
   holds its ring rank's image super-chunk (u consecutive chunks) for N/u heads.  Text q/k/v are already
   whole on every rank: each rank just keeps its N/u heads (no communication).
2. Ring: the image K/V super-chunks travel round the ring group (p2p shifts); every rank attends its
   queries (text + its image super-chunk) to text K/V (padding-masked) and to each image K/V chunk, and
   combines the partial results exactly with an online softmax (log-sum-exp).
3. Back: image outputs return to the sequence split by the inverse all-to-all; text outputs of the N/u
   heads are all-gathered over the ulysses group, so the text stream stays whole on every CP rank.

Gradient convention (megatron-core's CP convention): every CP rank back-propagates its own share of
the loss, and a parameter's true gradient is the SUM of the CP ranks' gradients (DDP reduces over the
data x context group; the schedules multiply the loss by cp_size to turn DDP's mean into that sum).
Each collective's backward below is chosen so that this holds for split and replicated tensors alike.

Legend: S sequence, T text tokens, I local image tokens, R image tokens of a ring rank, B batch,
N heads held before the all-to-all, n = N / ulysses, D head dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class ContextParallelGroups:
    """The context-parallel group and its ulysses (inner: consecutive CP ranks) x ring (outer) factors.
    A factor of size 1 has no group (None)."""

    cp_group: dist.ProcessGroup
    ulysses_group: dist.ProcessGroup | None
    ring_group: dist.ProcessGroup | None

    @property
    def cp(self) -> int:
        return self.cp_group.size()

    @property
    def ulysses(self) -> int:
        return 1 if self.ulysses_group is None else self.ulysses_group.size()

    @property
    def ring(self) -> int:
        return 1 if self.ring_group is None else self.ring_group.size()

    @property
    def cp_rank(self) -> int:
        return dist.get_rank(self.cp_group)

    @property
    def ulysses_rank(self) -> int:
        return 0 if self.ulysses_group is None else dist.get_rank(self.ulysses_group)


def new_context_parallel_groups(cp_group: dist.ProcessGroup, ulysses: int) -> ContextParallelGroups:
    """Split every CP group of the world into ulysses x ring sub-groups.  When both factors are > 1 this
    is collective over the WORLD (``dist.new_group`` is): every rank must call it, in the same order."""
    cp = cp_group.size()
    if ulysses < 1 or cp % ulysses:
        raise ValueError(f"ulysses={ulysses} does not divide the context-parallel size cp={cp}; expected a "
                         f"divisor of cp (ring = cp / ulysses)")
    ring = cp // ulysses
    if ulysses == 1 or ring == 1:
        return ContextParallelGroups(cp_group, cp_group if ulysses > 1 else None, cp_group if ring > 1 else None)
    mine = tuple(dist.get_process_group_ranks(cp_group))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    found = {}
    for ranks in sorted(set(every)):  # identical order on every rank
        subs = [("ulysses", ranks[r * ulysses:(r + 1) * ulysses]) for r in range(ring)]
        subs += [("ring", ranks[j::ulysses]) for j in range(ulysses)]
        for kind, sub in subs:
            group = dist.new_group(list(sub))
            if dist.get_rank() in sub:
                found[kind] = group
    return ContextParallelGroups(cp_group, found["ulysses"], found["ring"])


# ---- differentiable collectives ------------------------------------------------------------------

def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Chunk ``x`` along scatter_dim, send chunk j to rank j, concatenate what arrives along gather_dim."""
    size = group.size()
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Split tensor in, split tensor out: the backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


class _GatherHeads(torch.autograd.Function):
    """Each rank's head slice in, all heads out (replicated).  Backward: the sum over ranks of the
    gradient w.r.t. the whole output, sliced to this rank's heads (every rank's loss share reaches it)."""

    @staticmethod
    def forward(ctx, x, group, dim: int):
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.group.size(), dim=ctx.dim)[dist.get_rank(ctx.group)], None, None


def _start_shift(x: torch.Tensor, group, step: int) -> tuple[torch.Tensor, list]:
    """Start sending ``x`` to ring rank (r + step) and receiving from (r - step); (buffer, requests to wait)."""
    rank, size = dist.get_rank(group), group.size()
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), dist.get_global_rank(group, (rank + step) % size), group),
           dist.P2POp(dist.irecv, out, dist.get_global_rank(group, (rank - step) % size), group)]
    return out, dist.batch_isend_irecv(ops)


def _ring_shift(x: torch.Tensor, group, step: int) -> torch.Tensor:
    """Send ``x`` to ring rank (r + step), receive from (r - step)."""
    out, reqs = _start_shift(x, group, step)
    for req in reqs:
        req.wait()
    return out


class _RingShift(torch.autograd.Function):
    """K/V chunk to the next ring rank; its gradient goes back to the rank it came from."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _ring_shift(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return _ring_shift(grad, ctx.group, -1), None


class _GatherSequence(torch.autograd.Function):
    """Sequence chunks (dim 0) in, whole sequence out on every rank; backward keeps this rank's chunk of
    the gradient.  For a loss that every CP rank computes whole from the gathered output: each rank then
    owns the gradient of its chunk, as megatron's CP convention (loss x cp_size, DDP mean) expects."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.group.size(), dim=0)[dist.get_rank(ctx.group)].contiguous(), None


def gather_sequence(x_SBH: torch.Tensor, group) -> torch.Tensor:
    return _GatherSequence.apply(x_SBH, group)


# ---- ring attention with an online softmax -------------------------------------------------------
#
# Each K/V block runs through a flash kernel that also returns the rows' log-sum-exp (lse); blocks merge exactly:
# out = sum_i exp(lse_i - lse) out_i with lse = log sum_i exp(lse_i).  The backward runs the kernel's own backward
# per block with the MERGED out and lse: its softmax is then the global one, so the per-block dq, dk, dv are exact
# shares (dq summed here, each dk / dv sent back to the rank whose block it is).  Kernels: PyTorch's flash
# attention on CUDA (bf16 / fp16, no mask) and its CPU flash kernel (any float dtype, mask as an additive bias);
# elsewhere (float32 or a padded-text mask on CUDA) float32 matmul + log-sum-exp blocks under autograd.

_aten = torch.ops.aten


def _flash_ok(q: torch.Tensor, masked: bool) -> bool:
    if q.device.type == "cpu":
        return True
    return (q.is_cuda and not masked and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256)


def _joint_mask(txt_mask_B11T: torch.Tensor | None, img_BnRD: torch.Tensor) -> torch.Tensor | None:
    """The [text; image] key mask [B, 1, 1, T + R] of block 0 (image keys always visible), or None."""
    if txt_mask_B11T is None:
        return None
    ones = torch.ones(*txt_mask_B11T.shape[:3], img_BnRD.shape[2], dtype=torch.bool, device=img_BnRD.device)
    return torch.cat([txt_mask_B11T, ones], dim=-1)


def _bias(mask_B11K: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """A boolean mask as the additive bias the CPU flash kernel takes (of the query's dtype)."""
    if mask_B11K is None:
        return None
    return torch.zeros(mask_B11K.shape, dtype=dtype, device=mask_B11K.device).masked_fill(~mask_B11K, float("-inf"))


def _flash_forward(q, k, v, bias, scale):
    """(out [B, n, S, D], lse [B, n, S] float32, what the kernel's backward needs of this call)."""
    if q.is_cuda:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, False, False, scale=scale)
        if lse.shape != q.shape[:3]:  # (the merge reads one value per query row)
            raise RuntimeError(f"flash attention returned log-sum-exp of shape {tuple(lse.shape)}; expected "
                               f"{tuple(q.shape[:3])} for queries {tuple(q.shape)}")
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    return out, lse, ()


def _flash_backward(dout, q, k, v, out, lse, bias, saved, scale):
    """(dq, dk, dv) of one block given the merged ``out`` and ``lse``."""
    if q.is_cuda:
        cum_q, cum_k, max_q, max_k, seed, offset = saved
        return _aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k,
                                                                  0.0, False, seed, offset, scale=scale)
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, False,
                                                                      attn_mask=bias, scale=scale)


def _merge(out, lse, out_s, lse_s):
    """Two partial softmax results of the same rows as one (float32); ``out`` None: the first block."""
    out_s, lse_s = out_s.float(), lse_s.float()
    if out is None:
        return out_s, lse_s
    lse_new = torch.logaddexp(lse, lse_s)
    return (out * torch.exp(lse - lse_new).unsqueeze(-1) + out_s * torch.exp(lse_s - lse_new).unsqueeze(-1)), lse_new


class _RingFlashAttention(torch.autograd.Function):
    """softmax over [text K; every ring rank's image K] of q through flash kernels; see the comment above.
    Block 0 is [text; this rank's image] K/V (with the text mask), block s the image K/V of ring rank r - s;
    the next block's transfer runs while the current one is attended."""

    @staticmethod
    def forward(ctx, q, kt, vt, ki, vi, txt_mask_B11T, group):
        scale, ring = q.shape[-1] ** -0.5, group.size()
        k, v, bias = torch.cat([kt, ki], 2), torch.cat([vt, vi], 2), _bias(_joint_mask(txt_mask_B11T, ki), q.dtype)
        kv, out, lse, blocks = torch.stack([ki, vi]), None, None, []
        for s in range(ring):
            pending = _start_shift(kv, group, 1) if s < ring - 1 else None
            out_s, lse_s, saved = _flash_forward(q, k, v, bias, scale)
            out, lse = _merge(out, lse, out_s, lse_s)
            blocks.append((k, v, bias, saved))
            if pending is not None:
                kv, reqs = pending
                for req in reqs:
                    req.wait()
                k, v, bias = kv[0], kv[1], None
        out = out.to(q.dtype)
        ctx.group, ctx.scale, ctx.text_len, ctx.blocks = group, scale, kt.shape[2], blocks
        ctx.save_for_backward(q, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse = ctx.saved_tensors
        dout, dq, own = dout.contiguous(), None, None
        for s, (k, v, bias, saved) in enumerate(ctx.blocks):
            dq_s, dk, dv = _flash_backward(dout, q, k, v, out, lse, bias, saved, ctx.scale)
            dq = dq_s.float() if dq is None else dq + dq_s.float()
            if s == 0:  # [text; own image] keys
                dkt, dvt = dk[:, :, :ctx.text_len], dv[:, :, :ctx.text_len]
                own = torch.stack([dk[:, :, ctx.text_len:], dv[:, :, ctx.text_len:]]).float()
            else:  # block s came from ring rank r - s: its gradient goes back there, ours comes from r + s
                own = own + _ring_shift(torch.stack([dk, dv]), ctx.group, -s).float()
        ctx.blocks = None
        return dq.to(q.dtype), dkt, dvt, own[0].to(q.dtype), own[1].to(q.dtype), None, None


def _block_attention(q_BnSD, k_BnKD, v_BnKD, mask_B11K, scale):
    """Attention of q to one K/V block in float32: (out [B, n, S, D], log-sum-exp [B, n, S])."""
    scores = (q_BnSD @ k_BnKD.transpose(-1, -2)) * scale
    if mask_B11K is not None:
        scores = scores.masked_fill(~mask_B11K, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v_BnKD, lse


def ring_attention(q_BnSD, kt_BnTD, vt_BnTD, ki_BnRD, vi_BnRD, txt_mask_B11T, ring_group, flash: bool | None = None):
    """softmax over [text K; every ring rank's image K] of q, exact, without gathering K/V.

    Step 0 attends to text K/V (with the padding mask) and this rank's image K/V; step s attends to the
    image K/V of ring rank r - s, received by ``ring`` - 1 shifts.  Image keys are always visible, so every query
    row has at least one finite score.  Flash kernels where the device and dtype allow (``_RingFlashAttention``),
    else float32 blocks differentiated by autograd; ``flash`` forces one (None: the flash kernels when allowed).
    """
    if flash is None:
        flash = _flash_ok(q_BnSD, txt_mask_B11T is not None)
    if flash:
        return _RingFlashAttention.apply(q_BnSD, kt_BnTD, vt_BnTD, ki_BnRD, vi_BnRD, txt_mask_B11T, ring_group)
    dtype, scale = q_BnSD.dtype, 1.0 / math.sqrt(q_BnSD.shape[-1])
    q = q_BnSD.float()
    out, lse = _block_attention(q, torch.cat([kt_BnTD, ki_BnRD], 2).float(), torch.cat([vt_BnTD, vi_BnRD], 2).float(),
                                _joint_mask(txt_mask_B11T, ki_BnRD), scale)
    kv = torch.stack([ki_BnRD, vi_BnRD])
    for _ in range(ring_group.size() - 1):
        kv = _RingShift.apply(kv, ring_group)
        out, lse = _merge(out, lse, *_block_attention(q, kv[0].float(), kv[1].float(), None, scale))
    return out.to(dtype)


class USPJointCoreAttention(torch.nn.Module):
    """Drop-in for ``JointSDPACoreAttention`` under context parallelism: same ``forward(q, k, v, mask)``
    with q, k, v = cat([text (whole), this CP rank's image chunk]) of shape [T + I, B, N, D]; returns
    [T + I, B, N*D] for the same tokens.  ``text_len`` says where the split is."""

    def __init__(self, cp_groups: ContextParallelGroups):
        super().__init__()
        self.groups = cp_groups

    def forward(self, q_SBND, k_SBND, v_SBND, attn_mask_B11S=None, text_len: int = 0):
        g = self.groups
        s, b, heads, d = q_SBND.shape
        if heads % g.ulysses:
            raise ValueError(f"{heads} attention heads per tensor-parallel rank do not split over ulysses="
                             f"{g.ulysses}; expected num_attention_heads divisible by tp * ulysses")
        n = heads // g.ulysses
        own = slice(g.ulysses_rank * n, (g.ulysses_rank + 1) * n)

        def to_heads(x_SBND):  # -> text [B, n, T, D], image [B, n, R, D]
            txt, img = x_SBND[:text_len, :, own], x_SBND[text_len:]
            if g.ulysses > 1:
                img = _AllToAll.apply(img, g.ulysses_group, 2, 0)  # [I, B, N, D] -> [R, B, n, D]
            return txt.permute(1, 2, 0, 3), img.permute(1, 2, 0, 3)

        (qt, qi), (kt, ki), (vt, vi) = to_heads(q_SBND), to_heads(k_SBND), to_heads(v_SBND)
        txt_mask = None if attn_mask_B11S is None else attn_mask_B11S[..., :text_len]
        q = torch.cat([qt, qi], dim=2)
        if g.ring > 1:
            out_BnSD = ring_attention(q, kt, vt, ki, vi, txt_mask, g.ring_group)
        else:
            mask = None
            if txt_mask is not None:
                ones = torch.ones(b, 1, 1, ki.shape[2], dtype=torch.bool, device=q.device)
                mask = torch.cat([txt_mask, ones], dim=-1)
            out_BnSD = F.scaled_dot_product_attention(q, torch.cat([kt, ki], 2), torch.cat([vt, vi], 2),
                                                      attn_mask=mask)
        out_SBnD = out_BnSD.permute(2, 0, 1, 3)
        out_t, out_i = out_SBnD[:text_len], out_SBnD[text_len:]
        if g.ulysses > 1:
            out_i = _AllToAll.apply(out_i, g.ulysses_group, 0, 2)  # [R, B, n, D] -> [I, B, N, D]
            out_t = _GatherHeads.apply(out_t, g.ulysses_group, 2)  # [T, B, n, D] -> [T, B, N, D]
        return torch.cat([out_t, out_i]).reshape(s, b, heads * d)
