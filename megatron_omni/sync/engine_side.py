"""What the receiving side needs from an ``EmbeddedEngine``: the expected shapes per mode, the load
itself (base weights through ``engine.load_weights``; LoRA adapters into the engine model's
``LoRALinear``s, all-or-nothing) and the tensors it holds afterwards, for the checksum."""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from checkpoints_convert.convert import hf_state_from_mcore
from checkpoints_convert.mapping import hf_shapes
from checkpoints_convert.qwen_image import qwen_image_rules
from megatron_omni.sync.exporter import TensorMeta
from model_specs.common.lora import load_peft_state_dict, lora_modules, peft_state_dict, target_name


def expected_shapes(engine, mode: str) -> dict[str, tuple[int, ...]]:
    model = engine.model
    if mode == "lora":
        return {name: tuple(t.shape) for m in lora_modules(model).values()
                for name, t, dim in _global_adapters(m)}
    params = dict(model.named_parameters())
    rules = qwen_image_rules(engine.arch)
    glob = {r.mcore: tuple(s * (engine.tp_size if d == r.tp_dim else 1) for d, s in enumerate(params[r.mcore].shape))
            for r in rules}
    return hf_shapes(rules, glob)


def _global_adapters(m):
    for name, t, dim in m.peft_tensors():
        shape = list(t.shape)
        if dim is not None:
            shape[dim] *= m.tp_size
        yield name, torch.empty(shape, device="meta"), dim


def check_plan(engine, mode: str, plan: list[TensorMeta]) -> str:
    """'' when every sent tensor is known with the right shape, else a message naming the first bad one."""
    if mode == "lora" and not lora_modules(engine.model):
        return "LoRA-only sync, but the engine model has no LoRA adapters (apply_lora it like the trainer's)"
    expected = expected_shapes(engine, mode)
    for meta in plan:
        if meta.name not in expected:
            return f"tensor {meta.name!r} is not a parameter of the engine's model ({mode} sync)"
        if meta.shape != expected[meta.name]:
            return f"tensor {meta.name!r} has shape {meta.shape}; the engine expects {expected[meta.name]}"
        if not meta.dtype.is_floating_point:
            return f"tensor {meta.name!r} has dtype {meta.dtype}; expected floating point"
    return ""


def load(engine, mode: str, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
    if mode != "lora":
        engine.load_weights(pairs)
        return
    state = {name: t.detach().clone() for name, t in pairs}  # the buckets are reused: copy on receipt
    lock = getattr(engine, "_run_lock", None) or contextlib.nullcontext()
    with lock:
        load_peft_state_dict(engine.model, state)


def held(engine, mode: str) -> dict[str, torch.Tensor]:
    """The engine's tensors under the names the trainer sent (engine at TP=1)."""
    if mode == "lora":
        return peft_state_dict(engine.model)
    params = {target_name(n): p for n, p in engine.model.named_parameters() if not n.endswith(("lora_A", "lora_B"))}
    return dict(hf_state_from_mcore(engine.arch, params.__getitem__))
