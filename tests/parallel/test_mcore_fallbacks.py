"""The gradient-norm fallback: the same norm as megatron-core's local one, with no host round trip."""
import pytest
import torch
from megatron.core.optimizer import clip_grads
from megatron.core.utils import local_multi_tensor_l2_norm

from megatron_omni.parallel.cpu_compat import cuda_factories_on_cpu
from megatron_omni.parallel.mcore_fallbacks import foreach_l2_norm, use_fast_fallbacks

pytestmark = pytest.mark.numerics  # float32 norms summed in other orders than megatron's and torch's


def test_foreach_l2_norm_equals_megatrons_local_norm():
    g = torch.Generator().manual_seed(0)
    # megatron's builds a nested tensor of the norms: lists of equal length
    lists = [[torch.randn(37, 5, generator=g) * 10 ** k for k in range(-3, 3)],
             [torch.randn(4096 + k, generator=g) for k in range(6)]]
    flag = torch.zeros(1, dtype=torch.int)
    with cuda_factories_on_cpu():  # megatron's builds its result with device="cuda"
        theirs, _ = local_multi_tensor_l2_norm(2048 * 32, flag, lists, False)
    ours, none = foreach_l2_norm(2048 * 32, flag, lists, False)
    assert none is None and ours.shape == (1,) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    exact = torch.cat([t.double().flatten() for ts in lists for t in ts]).norm()
    assert abs(ours.item() - exact.item()) / exact.item() < 1e-6
    assert foreach_l2_norm(1, flag, [[]], False)[0].item() == 0.0
    with pytest.raises(ValueError, match="per_tensor=False"):
        foreach_l2_norm(1, flag, lists, True)


def test_use_fast_fallbacks_points_clip_grads_at_it(single_rank):
    saved = clip_grads.l2_norm_impl
    try:
        clip_grads.l2_norm_impl = local_multi_tensor_l2_norm
        assert use_fast_fallbacks() and clip_grads.l2_norm_impl is foreach_l2_norm
        assert use_fast_fallbacks()  # idempotent
        # grad norm through megatron's own clipping code, ours vs its local fallback
        grads = [torch.randn(64, 3), torch.randn(100)]
        expected = torch.cat([g.flatten() for g in grads]).norm().item()
        with cuda_factories_on_cpu():
            got = clip_grads.get_grad_norm_fp32(grads)
        assert abs(got - expected) / expected < 1e-6
    finally:
        clip_grads.l2_norm_impl = saved
