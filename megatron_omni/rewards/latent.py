"""Latent rewards: scorers of the denoiser's clean latents (DiNa-LRM-style), in process or over HTTP.

A latent reward declares ``reads = "latents"`` (registry.reads_of) and is called as ``reward(latents_NZHW, prompts,
metadata)``: the sampler's final latents unpacked to the VAE's latent image, float32 ``[N, Z, H, W]`` in the space
the flow runs in (the pipeline's normalised latents, before ``decode`` undoes the scaling / shift).  A run whose
rewards all read latents never calls the VAE (megatron_omni.trainer.build, ``Run.score``).

- ``latent_scorer``: a :class:`LatentScorer` in this process, at random init from ``seed`` or loaded from ``path``
  (a ``torch.save``d state dict);
- ``latent_http``: POSTs the latents to a server (``url``) that answers with the scores; the wire format is
  :func:`encode_request` / :func:`decode_request`, and :class:`LatentRewardServer` serves any latent reward with it
  (``python -m megatron_omni.rewards.latent --channels 16 --port 8000`` serves a ``latent_scorer``).

DiNa-LRM also conditions on the prompt and scores noisy latents at a timestep; here the scorer sees the clean
latents at the end of sampling, and the prompts travel with them for a server that reads them.
"""
from __future__ import annotations

import argparse
import base64
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence

import numpy as np
import torch

from megatron_omni.rewards.registry import RewardFn, register_reward, score_batch


class LatentScorer(torch.nn.Module):
    """A small convolutional scorer of latent images: two 3x3 convolutions (the second at stride 2), SiLU, mean
    over the grid, a linear head; ``[N, Z, H, W] -> [N]``."""

    def __init__(self, channels: int, hidden: int = 32):
        super().__init__()
        self.channels = channels
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(channels, hidden, 3, padding=1), torch.nn.SiLU(),
            torch.nn.Conv2d(hidden, hidden, 3, stride=2, padding=1), torch.nn.SiLU())
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, latents_NZHW: torch.Tensor) -> torch.Tensor:
        features_NF = self.body(latents_NZHW).mean(dim=(2, 3))
        return self.head(features_NF)[:, 0]


@register_reward("latent_scorer")
class LatentScorerReward:
    """A :class:`LatentScorer` of ``channels`` latent channels: loaded from ``path``, else drawn at random init from
    ``seed`` (the same scorer for the same seed, whatever the global RNG)."""

    reads = "latents"

    def __init__(self, channels: int = 16, hidden: int = 32, seed: int = 0, path: str | None = None,
                 device: str = "cpu"):
        if channels < 1 or hidden < 1:
            raise ValueError(f"latent_scorer channels={channels}, hidden={hidden}; expected integers >= 1")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = LatentScorer(channels, hidden)
        if path is not None:
            try:
                self.model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            except (OSError, RuntimeError) as err:
                raise ValueError(f"latent_scorer path={path!r}: {err}; expected a torch.save()d state dict of a "
                                 f"LatentScorer(channels={channels}, hidden={hidden})") from err
        self.model = self.model.to(device).eval().requires_grad_(False)
        self.device = torch.device(device)

    @torch.no_grad()
    def __call__(self, latents_NZHW: Any, prompts: Sequence[str], metadata: Sequence[dict] | None) -> torch.Tensor:
        latents_NZHW = torch.as_tensor(latents_NZHW)
        if latents_NZHW.ndim != 4 or latents_NZHW.shape[1] != self.model.channels:
            raise ValueError(f"latents of shape {tuple(latents_NZHW.shape)}; the scorer reads [N, Z, H, W] with "
                             f"Z = {self.model.channels} (set reward.options.channels to the VAE's latent channels)")
        return self.model(latents_NZHW.to(self.device, torch.float32)).cpu()

    def differentiable_scores(self, latents_NZHW: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """[N] scores with gradients in ``latents_NZHW`` (the scorer's own weights stay frozen): SRPO's reward."""
        if latents_NZHW.ndim != 4 or latents_NZHW.shape[1] != self.model.channels:
            raise ValueError(f"latents of shape {tuple(latents_NZHW.shape)}; the scorer reads [N, Z, H, W] with "
                             f"Z = {self.model.channels} (set reward.options.channels to the VAE's latent channels)")
        return self.model(latents_NZHW.to(self.device, torch.float32)).to(latents_NZHW.device)


# ---- HTTP: one JSON request per batch, float32 latents as base64 little-endian bytes -------------------------------

def encode_request(latents_NZHW: Any, prompts: Sequence[str], metadata: Sequence[dict] | None) -> bytes:
    """The request body: ``{"shape": [N, Z, H, W], "latents": base64 float32 LE C-order, "prompts", "metadata"}``."""
    array = torch.as_tensor(latents_NZHW).detach().to("cpu", torch.float32).numpy().astype("<f4", copy=False)
    return json.dumps({"shape": list(array.shape), "latents": base64.b64encode(array.tobytes()).decode("ascii"),
                       "prompts": list(prompts), "metadata": list(metadata or [])}, default=str).encode()


def decode_request(body: bytes) -> tuple[torch.Tensor, list[str], list[dict]]:
    """Inverse of :func:`encode_request`: (latents float32 [N, Z, H, W], prompts, metadata); ValueError on a bad
    body."""
    try:
        request = json.loads(body)
        shape = [int(d) for d in request["shape"]]
        flat = np.frombuffer(base64.b64decode(request["latents"]), dtype="<f4")
        latents = torch.from_numpy(flat.reshape(shape).copy())
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"bad latent-reward request ({type(err).__name__}: {err}); expected JSON with shape, "
                         f"latents (base64 float32), prompts, metadata") from None
    return latents, list(request.get("prompts", [])), list(request.get("metadata") or [])


@register_reward("latent_http")
class HTTPLatentReward:
    """Scores latents on a server: POST :func:`encode_request` to ``url``, which answers ``{"scores": [N floats]}``
    (or an HTTP error with ``{"error": message}``).  ``timeout_s`` bounds each request."""

    reads = "latents"

    def __init__(self, url: str, timeout_s: float = 60.0):
        parts = urllib.parse.urlparse(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"latent_http url={url!r}; expected http(s)://host:port/path")
        if not timeout_s > 0:
            raise ValueError(f"latent_http timeout_s={timeout_s}; expected > 0 seconds")
        self.url, self.timeout_s = url, timeout_s

    def __call__(self, latents_NZHW: Any, prompts: Sequence[str], metadata: Sequence[dict] | None) -> list:
        request = urllib.request.Request(self.url, data=encode_request(latents_NZHW, prompts, metadata),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            raise RuntimeError(f"latent reward server {self.url} answered HTTP {err.code}: {detail}; expected 200 "
                               f'with {{"scores": [...]}}') from None
        except (urllib.error.URLError, OSError) as err:
            raise ConnectionError(f"latent reward server {self.url} unreachable ({getattr(err, 'reason', err)}); "
                                  f"expected a server answering POST (python -m megatron_omni.rewards.latent)") from None
        if not isinstance(answer, dict) or "scores" not in answer:
            raise RuntimeError(f"latent reward server {self.url} answered {str(answer)[:120]}; expected "
                               f'{{"scores": [{len(prompts)} floats]}}')
        return answer["scores"]


class LatentRewardServer:
    """Serves a latent reward over HTTP (the ``latent_http`` wire format) from a background thread: start →
    ``url`` → POSTs scored by ``reward`` (each result checked as the loop checks it) → ``close()``."""

    def __init__(self, reward: RewardFn, host: str = "127.0.0.1", port: int = 0, name: str = "latent_server"):
        handler = type("Handler", (_Handler,), {"reward": staticmethod(reward), "reward_name": name})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="latent-reward-server", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/score"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()

    def __enter__(self) -> "LatentRewardServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Handler(BaseHTTPRequestHandler):
    reward: RewardFn
    reward_name: str

    def do_POST(self):  # noqa: N802 (http.server's name)
        try:
            latents, prompts, metadata = decode_request(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            scores = score_batch(self.reward_name, self.reward, latents, prompts, metadata or None)
            self._answer(200, {"scores": scores.tolist()})
        except Exception as err:  # the client's RewardError names the server's message
            self._answer(400 if isinstance(err, ValueError) else 500, {"error": f"{type(err).__name__}: {err}"})

    def _answer(self, code: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # one line per request on stderr is noise in a training log
        pass


def main(argv: Sequence[str] | None = None) -> None:
    """Serve a ``latent_scorer`` until interrupted: ``python -m megatron_omni.rewards.latent --channels 16``."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--channels", type=int, default=16, help="latent channels Z of the run's VAE")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="random init when --path is not given")
    parser.add_argument("--path", default=None, help="a torch.save()d LatentScorer state dict")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    server = LatentRewardServer(LatentScorerReward(args.channels, args.hidden, args.seed, args.path),
                                args.host, args.port)
    print(f"serving latent_scorer at {server.url}", flush=True)
    try:
        server.thread.join()
    except KeyboardInterrupt:
        server.close()


if __name__ == "__main__":
    main()
