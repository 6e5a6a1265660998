"""Ring attention's flash-kernel path (per-block kernel + log-sum-exp merge, per-block kernel backward with the
merged softmax) against its float32 autograd path: 3 gloo ranks (so a block's gradient travels back two hops),
padded text, float32 within 1e-5; and on a CUDA GPU, the flash kernel's per-block forward / backward merged over
two blocks against SDPA over the whole sequence in bf16."""
import pytest
import torch
import torch.nn.functional as F

from megatron_omni.parallel.testing import run_distributed

B, N, T, R, D = 2, 3, 5, 4, 16  # batch, heads, text tokens, image tokens per ring rank, head dim


def _inputs(rank: int):
    """Text q/k/v replicated on every rank, this rank's image chunk, a text mask with padding."""
    g = torch.Generator().manual_seed(0)
    txt = [torch.randn(B, N, T, D, generator=g) for _ in range(3)]
    g = torch.Generator().manual_seed(1 + rank)
    img = [torch.randn(B, N, R, D, generator=g) for _ in range(3)]
    mask = torch.ones(B, 1, 1, T, dtype=torch.bool)
    mask[1, ..., 3:] = False
    return txt, img, mask


def _ring_worker():
    import torch.distributed as dist

    from megatron_omni.parallel.usp import ring_attention

    dist.init_process_group("gloo")
    (qt, kt, vt), (qi, ki, vi), mask = _inputs(dist.get_rank())
    w = torch.randn(B, N, T + R, D, generator=torch.Generator().manual_seed(7 + dist.get_rank()))
    results = {}
    for flash in (True, False):
        leaves = [t.clone().requires_grad_() for t in (qt, kt, vt, qi, ki, vi)]
        q = torch.cat([leaves[0], leaves[3]], 2)
        out = ring_attention(q, leaves[1], leaves[2], leaves[4], leaves[5], mask, dist.group.WORLD, flash=flash)
        (out * w).sum().backward()
        grads = [t.grad.clone() for t in leaves]
        for g in grads[:3]:  # text q/k/v are replicated: their true gradient is the sum over ranks
            dist.all_reduce(g)
        results[flash] = (out.detach(), grads)
    dist.destroy_process_group()
    return results


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.numerics
def test_flash_ring_equals_float32_ring_3_ranks():
    for rank, res in enumerate(run_distributed(_ring_worker, world_size=3)):
        (out_f, grads_f), (out_m, grads_m) = res[True], res[False]
        assert _rel(out_f, out_m) <= 1e-5, rank
        for name, a, b in zip(("q_txt", "k_txt", "v_txt", "q_img", "k_img", "v_img"), grads_f, grads_m):
            assert b.norm() > 0 and _rel(a, b) <= 1e-5, (rank, name, _rel(a, b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_flash_blocks_merge_to_sdpa():
    """Two K/V blocks through the CUDA flash kernel, merged, and their backward with the merged out / lse: equal
    to SDPA (and its autograd) over all keys, bf16 within rounding."""
    from megatron_omni.parallel.usp import _flash_backward, _flash_forward, _merge

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 96, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn(2, 4, 96, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    scale, cut = 128 ** -0.5, 40
    blocks = [(k[:, :, :cut], v[:, :, :cut]), (k[:, :, cut:], v[:, :, cut:])]
    out = lse = None
    saved = []
    for kb, vb in blocks:
        o, l, s = _flash_forward(q, kb.contiguous(), vb.contiguous(), None, scale)
        saved.append(s)
        out, lse = _merge(out, lse, o, l)
    out = out.to(q.dtype)
    grads = [_flash_backward(dout, q, kb.contiguous(), vb.contiguous(), out, lse, None, s, scale)
             for (kb, vb), s in zip(blocks, saved)]
    dq = sum(gr[0].float() for gr in grads)
    dk, dv = torch.cat([gr[1] for gr in grads], 2), torch.cat([gr[2] for gr in grads], 2)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves)
    ref.backward(dout)
    for name, a, b in (("out", out, ref), ("dq", dq, leaves[0].grad), ("dk", dk, leaves[1].grad),
                       ("dv", dv, leaves[2].grad)):
        assert _rel(a.float(), b.float()) < 1e-2, (name, _rel(a.float(), b.float()))


def _cuda_ring_of_one():
    """The whole flash ring on a CUDA GPU with a ring of one rank (no transfer): bf16 flash vs float32 blocks."""
    import torch.distributed as dist

    from megatron_omni.parallel.usp import ring_attention

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # in this process: CUDA visible
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(2, 4, 24, 128), (2, 4, 24, 128), (2, 4, 24, 128), (2, 4, 80, 128), (2, 4, 80, 128), (2, 4, 80, 128)]
    base = [torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16) for s in shapes]
    w = torch.randn(2, 4, 104, 128, device="cuda", generator=g)
    results = []
    for flash in (True, False):
        leaves = [t.clone().requires_grad_() for t in base]
        q = torch.cat([leaves[0], leaves[3]], 2)
        out = ring_attention(q, leaves[1], leaves[2], leaves[4], leaves[5], None, dist.group.WORLD, flash=flash)
        (out.float() * w).sum().backward()
        results.append([out.detach().float().cpu()] + [t.grad.float().cpu() for t in leaves])
    dist.destroy_process_group()
    return results


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_flash_ring_of_one_equals_float32_blocks():
    flash, exact = _cuda_ring_of_one()
    for name, a, b in zip(("out", "q_txt", "k_txt", "v_txt", "q_img", "k_img", "v_img"), flash, exact):
        assert b.norm() > 0 and _rel(a, b) < 1e-2, (name, _rel(a, b))
