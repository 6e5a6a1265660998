"""Digit rewards: the CNN reward and the SVC judge, trained here (in a fresh cache) on load_digits and
measured on its held-out test split; right digits score high, other digits low; the cache is reused."""
import numpy as np
import pytest
import torch

from megatron_omni.rewards import build_reward
from megatron_omni.rewards.digit_models import load_digit_split, load_or_train_cnn
from megatron_omni.data.digits import DIGIT_NAMES, prompt_digit


@pytest.fixture(scope="module")
def split():
    return load_digit_split()


@pytest.fixture(scope="module")
def reward(digit_cache):
    return build_reward("digit_classifier", cache_dir=str(digit_cache))


@pytest.fixture(scope="module")
def judge(digit_cache):
    return build_reward("digit_judge", cache_dir=str(digit_cache))


def _prompts(digits) -> list[str]:
    return [f"a handwritten digit {DIGIT_NAMES[d]}" for d in digits]


def test_split_is_disjoint_and_stratified(split):
    parts = [set(split.reward_train), set(split.judge_train), set(split.test)]
    assert sum(map(len, parts)) == len(set().union(*parts)) == 1797  # reward, judge, test: no shared image
    assert split.images.shape == (1797, 16, 16) and 0 <= split.images.min() and split.images.max() <= 1
    assert np.bincount(split.labels[split.test]).min() >= 40  # every digit in the test split


def test_accuracy_and_right_vs_wrong_digit(reward, judge, split, report):
    x, y = split.images[split.test], split.labels[split.test]
    right, wrong = _prompts(y), _prompts((y + 1 + np.arange(len(y)) % 9) % 10)  # every other digit in turn
    for name, model in (("reward CNN", reward), ("judge SVC", judge)):
        accuracy = float((model.probabilities(x).argmax(-1) == y).mean())
        r, w = model(x, right, None), model(x, wrong, None)
        report(f"{name}: test accuracy {accuracy:.3f} on {len(y)} held-out images "
               f"(trained in {model.train_seconds:.2f} s); P(prompt digit) right {r.mean():.3f}, wrong {w.mean():.3f}")
        assert accuracy == pytest.approx(model.test_accuracy) and accuracy >= 0.95
        assert r.mean() >= 0.85 and w.mean() <= 0.05


def test_reward_and_judge_disagree_on_noise(reward, judge):
    """Independent models: on images far from the data their probabilities differ (they share nothing)."""
    noise = torch.rand(64, 16, 16, generator=torch.Generator().manual_seed(0))
    gap = np.abs(reward.probabilities(noise) - judge.probabilities(noise)).max(-1).mean()
    assert gap > 0.1


def test_cache_is_reused_and_training_is_deterministic(reward, digit_cache, tmp_path):
    again = build_reward("digit_classifier", cache_dir=str(digit_cache))
    assert again.train_seconds == 0.0  # loaded, not retrained
    retrained = load_or_train_cnn(tmp_path).model.state_dict()
    for name, value in reward.model.state_dict().items():
        torch.testing.assert_close(retrained[name], value, rtol=0, atol=0, msg=f"{name} differs")


@pytest.mark.numerics
def test_image_formats_agree(reward, split):
    x16 = split.images[:8]  # float [8, 16, 16]
    prompts = _prompts(split.labels[:8])
    base = reward(x16, prompts, None)
    np.testing.assert_allclose(reward(x16[:, None], prompts, None), base)  # [N, 1, H, W]
    u8 = (x16 * 255).round().to(torch.uint8)[..., None].expand(-1, -1, -1, 3)  # uint8 RGB [N, H, W, 3]
    np.testing.assert_allclose(reward(u8, prompts, None), base, atol=0.02)
    from sklearn.datasets import load_digits
    x8 = torch.tensor(load_digits().images[:8], dtype=torch.float32) / 16  # native 8x8, upsampled inside
    np.testing.assert_allclose(reward(x8, prompts, None), base, atol=1e-5)


def test_clear_errors(reward):
    with pytest.raises(ValueError, match=r"range over \[-1, 1\]; expected \[0, 1\] .* \(x \+ 1\) / 2"):
        reward(torch.linspace(-1, 1, 256).view(1, 16, 16), _prompts([3]), None)
    with pytest.raises(ValueError, match=r"shape \(1, 28, 28\); expected \[N, 16, 16\] or \[N, 8, 8\]"):
        reward(torch.zeros(1, 28, 28), _prompts([3]), None)
    with pytest.raises(ValueError, match=r"'a handwritten seven or eight' names \['eight', 'seven'\]; expected exactly one"):
        prompt_digit("a handwritten seven or eight")
    with pytest.raises(ValueError, match="'a cat' names no digit"):
        reward(torch.zeros(1, 16, 16), ["a cat"], None)
    assert prompt_digit("A Handwritten Digit Seven") == 7
