"""EMAPolicy (DiffusionNFT's ``old_policy: ema``): the average by hand over updates, the swap restoring the weights
bit for bit, only trained parameters averaged, and a bad decay refused."""
import pytest
import torch

from megatron_omni.algorithms.ema_policy import EMAPolicy
from megatron_omni.config import ConfigError, load_config


def _module():
    m = torch.nn.Linear(3, 2)
    m.bias.requires_grad_(False)  # a frozen parameter (a LoRA base's) is not averaged
    return m


def test_average_by_hand_and_the_swap():
    m = _module()
    w0 = m.weight.detach().clone()
    ema = EMAPolicy([m], decay=0.75)
    assert len(ema.params) == 1 and ema.params[0] is m.weight
    with torch.no_grad():
        m.weight.add_(1.0)
    ema.update()  # 0.75·w0 + 0.25·(w0 + 1)
    with torch.no_grad():
        m.weight.add_(2.0)
    ema.update()  # 0.75·(w0 + 0.25) + 0.25·(w0 + 3)
    want = w0 + 0.75 * 0.25 + 0.25 * 3.0
    assert torch.allclose(ema.ema[0], want, atol=1e-6)
    current = m.weight.detach().clone()
    x = torch.randn(4, 3)
    with ema.swapped_in():
        assert torch.equal(m.weight, ema.ema[0])
        y_old = m(x)
    assert torch.equal(m.weight, current)  # restored exactly
    assert torch.allclose(y_old, x @ want.T + m.bias, atol=1e-6)


def test_decay_zero_is_the_last_weights():
    m = _module()
    ema = EMAPolicy([m], decay=0.0)
    with torch.no_grad():
        m.weight.mul_(3.0)
    ema.update()
    assert torch.equal(ema.ema[0], m.weight.detach())


def test_bad_decay_refused():
    with pytest.raises(ValueError, match=r"ema decay must be in \[0, 1\); got 1.0"):
        EMAPolicy([_module()], decay=1.0)
    with pytest.raises(ConfigError, match=r"algorithm.diffusion_nft.ema_decay: 1.5 is outside \[0, 1\)"):
        load_config("digits_flow_grpo", None, ["algorithm.name=diffusion_nft", "algorithm.diffusion_nft.old_policy=ema",
                                               "algorithm.diffusion_nft.ema_decay=1.5"])
