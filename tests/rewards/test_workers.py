"""AsyncRewardPool: same scores as the synchronous path, submit returns while rewards still run, and a
bad reward result is an error naming the reward and the sample."""
import threading
import time

import numpy as np
import pytest
import torch

from megatron_omni.rewards import AsyncRewardPool, RewardError, build_reward, compute_rewards
from megatron_omni.data.digits import DIGIT_NAMES
from tests.rewards.test_ocr import needs_tesseract, render


def _digit_batch(split, n=24):
    idx = split.test[:n]
    return split.images[idx], [f"a handwritten digit {DIGIT_NAMES[d]}" for d in split.labels[idx]]


@pytest.fixture(scope="module")
def digit_rewards(digit_cache):
    return {"digit": build_reward("digit_classifier", cache_dir=str(digit_cache)),
            "judge": build_reward("digit_judge", cache_dir=str(digit_cache))}


@pytest.mark.numerics
@pytest.mark.parametrize("chunk_size", [None, 5])
def test_async_equals_sync(digit_rewards, chunk_size):
    """chunk_size=None: each worker scores the whole batch of 24, as the synchronous path does, with the same
    thread count (a new thread reads torch's global one): the same kernels, so the same bits.  chunk_size=5: the
    CNN sees batches of 5 and 4, whose float32 convolutions and GEMMs are blocked (and vectorised) otherwise than
    at 24 rows: ~1e-7 relative per op, a few layers and a softmax deep (measured on an AVX-512 Xeon: <= 4.2e-7) ->
    atol 1e-5 on probabilities in [0, 1].  A chunk scored against another chunk's prompts, or chunks put back in
    the wrong order, changes a score by ~0.1 or more (right vs wrong digit: >= 0.85 vs <= 0.05 on average)."""
    from megatron_omni.rewards.digit_models import load_digit_split

    images, prompts = _digit_batch(load_digit_split())
    expected = compute_rewards(digit_rewards, images, prompts)
    with AsyncRewardPool(digit_rewards, num_workers=3, chunk_size=chunk_size) as pool:
        futures = [pool.submit(images, prompts) for _ in range(3)]  # several batches in flight
        for future in futures:
            got = future.result(timeout=60)
            assert got.keys() == expected.keys()
            for name in expected:
                if chunk_size is None:
                    np.testing.assert_array_equal(got[name], expected[name])
                else:
                    np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-5)


@needs_tesseract
def test_ocr_and_jpeg_in_the_pool_equal_sync():
    prompts = [f'a sign reading "{t}"' for t in ("Open Late", "Gate 7", "Fresh Bread", "No Parking")]
    images = [render(t) for t in ("Open Late", "Gate 7", "Fresh Bread", "Parking")]
    rewards = {"ocr": build_reward("ocr"), "jpeg": build_reward("jpeg_compressibility")}
    with AsyncRewardPool(rewards, num_workers=2, chunk_size=2) as pool:
        got = pool.submit(images, prompts).result(timeout=60)
    expected = compute_rewards(rewards, images, prompts)
    for name in rewards:
        np.testing.assert_array_equal(got[name], expected[name])
    assert got["ocr"].tolist() == [1.0, 1.0, 1.0, pytest.approx(7 / 9)]  # "parking" vs "noparking"


def test_submit_returns_before_the_reward_finishes(report):
    """The reward blocks until the caller — already back from submit — releases it: overlap, not luck."""
    released, started = threading.Event(), threading.Event()

    def waits(images, prompts, metadata):
        started.set()
        if not released.wait(timeout=30):
            raise TimeoutError("never released: submit blocked the caller")
        return np.ones(len(prompts))

    with AsyncRewardPool({"waits": waits}, num_workers=1) as pool:
        t0 = time.perf_counter()
        future = pool.submit(np.zeros((4, 8, 8, 3), np.uint8), ["p"] * 4)
        submit_s = time.perf_counter() - t0
        assert started.wait(timeout=10) and not future.done()
        released.set()
        assert future.result(timeout=10)["waits"].tolist() == [1.0] * 4
    report(f"submit returned in {submit_s * 1e3:.2f} ms while the reward was still running")


@pytest.mark.parametrize("bad, message", [
    ("nan", r"reward 'bad' returned nan for sample 6 \(prompt 'prompt 6'\); expected a finite float"),
    ("short", r"reward 'bad' returned shape \(3,\) for 4 samples \(indices 4..7\); expected \(4,\)"),
    ("raise", r"reward 'bad' raised RuntimeError on samples 4..7 \(first prompt 'prompt 4'\): engine died"),
])
def test_bad_reward_results_name_reward_and_sample(bad, message):
    def reward(images, prompts, metadata):
        scores = np.arange(len(prompts), dtype=np.float64)
        if "prompt 6" in prompts:  # only the second chunk misbehaves: the index must be global
            if bad == "raise":
                raise RuntimeError("engine died")
            scores = scores[:-1] if bad == "short" else np.where(np.array(prompts) == "prompt 6", np.nan, scores)
        return torch.from_numpy(scores)

    prompts = [f"prompt {i}" for i in range(8)]
    with AsyncRewardPool({"ok": lambda i, p, m: np.zeros(len(p)), "bad": reward}, chunk_size=4) as pool:
        future = pool.submit(np.zeros((8, 4, 4, 3), np.uint8), prompts)
        with pytest.raises(RewardError, match=message):
            future.result(timeout=30)


def test_pool_errors():
    with pytest.raises(ValueError, match="got no rewards"):
        AsyncRewardPool({})
    with pytest.raises(TypeError, match=r"rewards \['x'\] are not callable"):
        AsyncRewardPool({"x": 3})
    pool = AsyncRewardPool({"zero": lambda i, p, m: np.zeros(len(p))})
    with pytest.raises(ValueError, match="got 2 images but prompts="):
        pool.submit(np.zeros((2, 4, 4, 3), np.uint8), ["only one"])
    pool.close()
    with pytest.raises(RuntimeError, match=r"submit after close\(\)"):
        pool.submit(np.zeros((1, 4, 4, 3), np.uint8), ["p"])


def test_result_timeout_names_pending_rewards():
    gate = threading.Event()
    with AsyncRewardPool({"slow": lambda i, p, m: gate.wait(10) and np.zeros(len(p))}) as pool:
        future = pool.submit(np.zeros((1, 4, 4, 3), np.uint8), ["p"])
        with pytest.raises(TimeoutError, match=r"rewards \['slow'\] not done after 0.05 s"):
            future.result(timeout=0.05)
        gate.set()
