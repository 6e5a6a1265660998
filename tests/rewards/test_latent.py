"""Latent rewards (megatron_omni.rewards.latent): the in-process scorer, the HTTP client against a real local server
scoring with the same random-init scorer, what the pool hands each kind of reward, and the config's checks."""
import socket

import numpy as np
import pytest
import torch

from megatron_omni.config.loader import load_config
from megatron_omni.config.schema import ConfigError
from megatron_omni.rewards import AsyncRewardPool, RewardError, build_reward, compute_rewards, reads_of
from megatron_omni.rewards.latent import LatentRewardServer, LatentScorer, decode_request, encode_request

PROMPTS = [f"prompt {i}" for i in range(5)]


def _latents(seed=0, n=5, z=16, h=6, w=10):
    return torch.randn(n, z, h, w, generator=torch.Generator().manual_seed(seed))


def test_in_process_scorer_is_a_seeded_model_of_the_latents():
    latents = _latents()
    reward = build_reward("latent_scorer", channels=16, seed=3)
    assert reads_of(reward) == "latents" and reads_of(build_reward("jpeg_compressibility")) == "images"
    scores = compute_rewards({"latent": reward}, latents, PROMPTS)["latent"]
    torch.manual_seed(123)  # the global RNG does not change the scorer
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = LatentScorer(16)
    np.testing.assert_array_equal(scores, model(latents).detach().double().numpy())
    assert np.ptp(scores) > 0  # a score per sample, not a constant
    other = compute_rewards({"latent": build_reward("latent_scorer", channels=16, seed=4)}, latents, PROMPTS)
    assert np.abs(other["latent"] - scores).max() > 1e-4
    with pytest.raises(RewardError, match=r"Z = 16 \(set reward.options.channels"):
        compute_rewards({"latent": reward}, _latents(z=4), PROMPTS)


def test_pool_gives_each_reward_what_it_reads():
    latents = _latents(1)
    images = torch.randint(0, 256, (5, 8, 8, 3), dtype=torch.uint8)
    fns = {"latent": build_reward("latent_scorer", channels=16, seed=0), "jpeg": build_reward("jpeg_compressibility")}
    with AsyncRewardPool(fns, num_workers=2) as pool:
        assert pool.reads("images") and pool.reads("latents")
        got = pool.submit(images, PROMPTS, latents=latents).result()
        with pytest.raises(ValueError, match=r"rewards \{'latent': 'latents'\} read inputs that were not given"):
            pool.submit(images, PROMPTS)
    np.testing.assert_array_equal(got["latent"], compute_rewards({"l": fns["latent"]}, latents, PROMPTS)["l"])
    np.testing.assert_array_equal(got["jpeg"], compute_rewards({"j": fns["jpeg"]}, images, PROMPTS)["j"])
    with AsyncRewardPool({"latent": fns["latent"]}) as pool:  # latent rewards only: no images needed
        assert not pool.reads("images")
        np.testing.assert_array_equal(pool.submit(None, PROMPTS, latents=latents).result()["latent"], got["latent"])


def test_wire_format_round_trips_float32_exactly():
    latents = _latents(2)
    back, prompts, metadata = decode_request(encode_request(latents, PROMPTS, [{"k": i} for i in range(5)]))
    assert torch.equal(back, latents) and prompts == PROMPTS and metadata == [{"k": i} for i in range(5)]
    with pytest.raises(ValueError, match="bad latent-reward request"):
        decode_request(b'{"shape": [2, 3], "latents": ""}')


def test_http_reward_equals_the_served_scorer():
    """A real server on a local port, scoring with a random-init scorer; the client's scores are the scorer's
    (float32 -> JSON -> float64 is exact), errors on the server side reach the loop with its message."""
    latents = _latents(3)
    served = build_reward("latent_scorer", channels=16, seed=5)
    # per request of the pool's chunks of 2: the scorer's convolutions block a batch of 2 otherwise than one of 5
    expected = np.concatenate([compute_rewards({"s": served}, latents[s:s + 2], PROMPTS[s:s + 2])["s"]
                               for s in range(0, 5, 2)])
    with LatentRewardServer(served) as server:
        client = build_reward("latent_http", url=server.url, timeout_s=30)
        with AsyncRewardPool({"remote": client}, num_workers=2, chunk_size=2) as pool:  # 3 requests at once
            got = pool.submit(None, PROMPTS, latents=latents).result()["remote"]
        np.testing.assert_array_equal(got, expected)
        with pytest.raises(RewardError, match=r"answered HTTP 500: .*Z = 16"):
            compute_rewards({"remote": client}, _latents(z=4), PROMPTS)
        url = server.url
    with pytest.raises(RewardError, match=r"latent reward server .* unreachable"):  # stopped: nothing listens
        compute_rewards({"remote": build_reward("latent_http", url=url, timeout_s=5)}, latents, PROMPTS)


def test_http_reward_refuses_a_bad_url_and_timeout():
    with pytest.raises(ValueError, match=r"url='localhost:8000'; expected http\(s\)://host:port/path"):
        build_reward("latent_http", url="localhost:8000")
    with pytest.raises(ValueError, match="timeout_s=0; expected > 0"):
        build_reward("latent_http", url="http://127.0.0.1:1/score", timeout_s=0)


def test_http_reward_times_out_on_a_silent_server():
    with socket.socket() as listener:  # accepts connections, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/score"
        with pytest.raises(RewardError, match="unreachable"):
            compute_rewards({"remote": build_reward("latent_http", url=url, timeout_s=0.5)}, _latents(), PROMPTS)


def test_config_checks_reward_options():
    cfg = load_config(overrides=["reward.name=latent_http", "reward.options.url=http://127.0.0.1:9/score",
                                 "reward.judge=null"])
    assert cfg.reward.options == {"url": "http://127.0.0.1:9/score"}
    with pytest.raises(ConfigError, match=r"reward.options: .*'latent_http' \(missing a required argument: 'url'\)"):
        load_config(overrides=["reward.name=latent_http"])
    with pytest.raises(ConfigError, match=r"reward.options: options \['chanels'\] .* expected keys among "
                                          r"\['channels', 'hidden', 'seed', 'path', 'device'\]"):
        load_config(overrides=["reward.name=latent_scorer", "reward.options.chanels=4"])
    with pytest.raises(ConfigError, match=r"reward.judge: unknown reward 'nope'; expected one of"):
        load_config(overrides=["reward.judge=nope"])


def test_pool_refuses_an_unknown_input_kind():
    class Pixels:
        reads = "pixels"

        def __call__(self, images, prompts, metadata):
            return [0.0] * len(prompts)

    with pytest.raises(ValueError, match=r"declares reads='pixels'; expected one of \('images', 'latents'\)"):
        AsyncRewardPool({"bad": Pixels()})


def test_in_process_scorer_has_gradients_for_srpo():
    """``latent_scorer`` is a differentiable reward (``differentiable_scores``): its values are the reward's, with
    gradients in the latents and none in its frozen weights; SRPO may train on it."""
    from megatron_omni.rewards.registry import has_gradient

    assert has_gradient("latent_scorer") and not has_gradient("latent_http")
    reward = build_reward("latent_scorer", channels=4, seed=3)
    latents = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    scores = reward.differentiable_scores(latents, ["a"] * 3)
    assert torch.allclose(scores.detach(), reward(latents.detach(), ["a"] * 3, None), rtol=0, atol=0)
    scores.sum().backward()
    assert latents.grad is not None and latents.grad.abs().sum() > 0
    assert all(p.grad is None for p in reward.model.parameters())
    with pytest.raises(ValueError, match="Z = 4"):
        reward.differentiable_scores(torch.zeros(1, 3, 8, 8), ["a"])
