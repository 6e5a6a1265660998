"""The registry of RL algorithms: name -> the module holding its ``ALGORITHM`` (megatron_omni.algorithms.base).
One line per algorithm; modules are imported when first asked for."""
from __future__ import annotations

import importlib

ALGORITHMS = {
    "flow_grpo": "megatron_omni.algorithms.flow_grpo",
    "mix_grpo": "megatron_omni.algorithms.mix_grpo",
    "grpo_guard": "megatron_omni.algorithms.grpo_guard",
    "flow_dppo": "megatron_omni.algorithms.flow_dppo",
    "dance_grpo": "megatron_omni.algorithms.dance_grpo",
    "diffusion_dpo": "megatron_omni.algorithms.diffusion_dpo",
    "diffusion_nft": "megatron_omni.algorithms.diffusion_nft",
    "srpo": "megatron_omni.algorithms.srpo",
}


def algorithm_names() -> list[str]:
    return sorted(ALGORITHMS)


def get_algorithm(name: str):
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {algorithm_names()}")
    return importlib.import_module(ALGORITHMS[name]).ALGORITHM
