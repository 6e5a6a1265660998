"""The registry and the result checks every reward goes through."""
import numpy as np
import pytest
import torch

from megatron_omni.rewards import (RewardError, build_reward, check_rewards, compute_rewards, list_rewards,
                                   register_reward)
from megatron_omni.rewards import registry

PROMPTS = ["p0", "p1", "p2"]


def test_known_rewards_and_unknown_name_lists_them():
    assert {"jpeg_compressibility", "jpeg_incompressibility", "ocr", "digit_classifier", "digit_judge"} \
        <= set(list_rewards())
    with pytest.raises(KeyError, match=r"unknown reward 'aesthetic'; expected one of \['digit_classifier'"):
        build_reward("aesthetic")


def test_register_and_build_with_options(monkeypatch):
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))  # the test reward stays local

    @register_reward("test_constant")
    class Constant:
        def __init__(self, value=1.0):
            self.value = value

        def __call__(self, images, prompts, metadata):
            return np.full(len(prompts), self.value)

    assert build_reward("test_constant", value=2.5)(np.zeros((3, 4, 4, 3), np.uint8), PROMPTS, None).tolist() \
        == [2.5] * 3
    with pytest.raises(ValueError, match="'test_constant' is already registered"):
        register_reward("test_constant")(lambda: None)


def test_check_rewards_names_reward_and_sample():
    assert check_rewards("r", torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16), PROMPTS).dtype == np.float64
    with pytest.raises(RewardError, match=r"reward 'r' returned nan for sample 1 \(prompt 'p1'\)"):
        check_rewards("r", [0.0, float("nan"), 1.0], PROMPTS)
    with pytest.raises(RewardError, match=r"reward 'r' returned inf for sample 7 \(prompt 'p2'\)"):
        check_rewards("r", [0.0, 1.0, float("inf")], PROMPTS, offset=5)
    with pytest.raises(RewardError, match=r"reward 'r' returned shape \(2,\) for 3 samples .* expected \(3,\)"):
        check_rewards("r", [0.0, 1.0], PROMPTS)


def test_compute_rewards_wraps_a_raising_reward():
    def broken(images, prompts, metadata):
        raise ZeroDivisionError("boom")

    images = np.zeros((3, 4, 4, 3), np.uint8)
    with pytest.raises(RewardError, match=r"reward 'broken' raised ZeroDivisionError on samples 0..2 "
                                          r"\(first prompt 'p0'\): boom"):
        compute_rewards({"broken": broken}, images, PROMPTS)
    with pytest.raises(ValueError, match="got 3 images but 2 metadata entries"):
        compute_rewards({"broken": broken}, images, PROMPTS, [{}, {}])
