"""``EMAPolicy``: an exponential moving average of the policy's trained parameters, an algorithm's state between RL
steps (DiffusionNFT's previous policy with ``old_policy: ema``).  Protocol: ``update`` after each RL step's
optimizer steps -> ``swapped_in`` around a forward-only pass of the old policy -> ``sharded_state_dict`` into every
checkpoint (loaded back in place on resume).

θ_ema starts at the initial weights and after each RL step becomes d·θ_ema + (1 − d)·θ, in float32 (d = 0 is the
last update's weights: the "copy" old policy).  Only the trained parameters (``requires_grad``: the adapters under
LoRA) are averaged; the others never move.  Each rank keeps its own shard (TP) and stage (PP): the checkpoint's
entries mirror the weights' own sharded entries, so a resume at the same layout loads them bit for bit.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Iterator

import torch

KEY_PREFIX = "algorithm_state.ema."


class EMAPolicy:
    def __init__(self, modules: list[torch.nn.Module], decay: float):
        if not 0 <= decay < 1:
            raise ValueError(f"ema decay must be in [0, 1); got {decay!r}")
        self.decay = decay
        self.params = [p for m in modules for p in m.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the policy has no trained parameters to average")
        self.ema = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        """θ_ema ← d·θ_ema + (1 − d)·θ."""
        for avg, p in zip(self.ema, self.params):
            avg.mul_(self.decay).add_(p.detach().float(), alpha=1 - self.decay)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The policy's parameters hold θ_ema inside (cast to their dtype); θ is restored exactly after."""
        with torch.no_grad():
            kept = [p.detach().clone() for p in self.params]
            for avg, p in zip(self.ema, self.params):
                p.copy_(avg)
        try:
            yield
        finally:
            with torch.no_grad():
                for k, p in zip(kept, self.params):
                    p.copy_(k)

    def sharded_state_dict(self, model_sd: dict) -> dict:
        """megatron ShardedTensors of θ_ema, one per trained parameter's entry of ``model_sd`` (the weights' sharded
        state dict: same shape, offsets and replica ids, key prefixed ``KEY_PREFIX``)."""
        from megatron.core.dist_checkpointing import ShardedTensor

        index = {p.data_ptr(): k for k, p in enumerate(self.params)}
        out, self._entries = {}, {}
        for name, sh in model_sd.items():
            k = index.get(sh.data.data_ptr()) if isinstance(sh, ShardedTensor) else None
            if k is not None and sh.data.shape == self.params[k].shape:
                out[name] = dataclasses.replace(sh, key=KEY_PREFIX + sh.key, data=self.ema[k], dtype=torch.float32)
                self._entries[name] = k
        if len(out) != len(self.params):
            raise ValueError(f"{len(self.params) - len(out)} of the {len(self.params)} averaged parameters have no "
                             f"entry in the weights' sharded state dict; expected one each to checkpoint them")
        return out

    def load(self, loaded: dict) -> None:
        """Take θ_ema from ``loaded``: what dist_checkpointing.load gave for the entries of the last
        ``sharded_state_dict`` call."""
        for name, k in self._entries.items():
            self.ema[k].copy_(loaded[name])
