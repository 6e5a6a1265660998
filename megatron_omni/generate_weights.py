"""The weights ``megatron-omni generate`` samples with, on the Megatron denoiser of a pipeline folder's arch (TP = 1):

* the folder's own transformer (``folder_denoiser``: the mapping table from its diffusers tensors);
* plus a diffusers LoRA folder (``attach_lora``): ``pytorch_lora_weights.safetensors`` with keys
  ``transformer.<module>.lora_A.weight`` / ``.lora_B.weight`` and the peft LoraConfig in its
  ``lora_adapter_metadata`` (``megatron-omni export`` and diffusers' ``save_lora_weights`` write it).  Without the
  metadata the rank is read from the tensors and alpha = rank, the targets from the names, as diffusers'
  ``load_lora_weights`` does; adapters of several ranks (peft's rank_pattern) are refused;
* or a training checkpoint's policy (``checkpoint_policy``: megatron_omni.export's rebuild, base and adapters).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_omni.export import LORA_METADATA_KEY, LORA_WEIGHTS, find_step, load_policy, read_run_config


class GenerateError(ValueError):
    """An input ``megatron-omni generate`` cannot use: one clear message, nothing written."""


def folder_denoiser(family, arch, folder, dtype: torch.dtype, state) -> torch.nn.Module:
    """The family's Megatron denoiser with the transformer folder's weights (``folder``: an HFFolder)."""
    from checkpoints_convert.convert import mcore_state_from_hf

    try:
        family.check_layout(arch, 1)
    except ValueError as e:
        raise GenerateError(f"{folder.path / 'config.json'}: {e}") from None
    config = family.transformer_config(arch, 1, params_dtype=dtype, perform_initialization=False)
    # the local backend: LoRA wraps megatron-core's own parallel linears
    module = family.build(arch, config, state.tp_group, "local").to(state.torch_device)
    result = module.load_state_dict(mcore_state_from_hf(arch, folder.get, 0, 1), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise GenerateError(f"{folder.path}: the mapping table left {len(missing)} parameter(s) unset (e.g. "
                            f"{missing[:3]}) and {len(result.unexpected_keys)} unknown (e.g. "
                            f"{result.unexpected_keys[:3]})")
    return module


def read_lora(folder: str | Path, prefix: str) -> tuple[int, float, list[str], dict[str, torch.Tensor]]:
    """(rank, alpha, target modules, peft tensors without ``prefix.``) of a diffusers LoRA folder."""
    from safetensors import safe_open

    path = Path(folder) / LORA_WEIGHTS
    if not path.is_file():
        raise GenerateError(f"--lora {folder}: {path} is missing; expected a diffusers LoRA folder (what "
                            f"`megatron-omni export` or save_lora_weights writes)")
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if foreign := [k for k in tensors if not k.startswith(f"{prefix}.")]:
        raise GenerateError(f"{path}: {len(foreign)} tensor(s) outside the {prefix!r} component, e.g. "
                            f"{foreign[0]!r}; expected keys {prefix}.<module>.lora_A.weight / .lora_B.weight")
    tensors = {k.removeprefix(f"{prefix}."): v for k, v in tensors.items()}
    config = json.loads(metadata[LORA_METADATA_KEY]) if LORA_METADATA_KEY in metadata else {}
    config = {k.removeprefix(f"{prefix}."): v for k, v in config.items()}
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise GenerateError(f"{path}: per-module ranks or alphas (rank_pattern / alpha_pattern) are not "
                            f"supported; expected one rank and alpha for every adapter")
    ranks = {t.shape[1] for k, t in tensors.items() if k.endswith(".lora_B.weight")}
    if len(ranks) != 1:
        raise GenerateError(f"{path}: adapters of ranks {sorted(ranks)}; expected one rank (and lora_B tensors)")
    rank = int(config.get("r", ranks.pop()))
    targets = config.get("target_modules") or sorted({k.rsplit(".lora_", 1)[0] for k in tensors})
    return rank, float(config.get("lora_alpha", rank)), list(targets), tensors


def attach_lora(module: torch.nn.Module, folder: str | Path, family, arch) -> None:
    """Wrap the LoRA folder's target linears of ``module`` and load its adapters (alpha / r as recorded)."""
    from model_specs.common.lora import apply_lora, load_peft_state_dict, lora_modules

    rank, alpha, targets, tensors = read_lora(folder, family.experts[0])
    try:
        apply_lora(module, rank, alpha, targets, family.rules(arch))
    except ValueError as e:
        raise GenerateError(f"--lora {folder}: {e}") from None
    expected = {name for m in lora_modules(module).values() for name, _, _ in m.peft_tensors()}
    missing, unknown = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unknown:
        raise GenerateError(f"--lora {folder}: its tensors are not the adapters of its target_modules: "
                            f"{len(missing)} missing (e.g. {missing[:2]}), {len(unknown)} unknown (e.g. {unknown[:2]})")
    try:
        load_peft_state_dict(module, tensors)
    except ValueError as e:
        raise GenerateError(f"--lora {folder}: {e}") from None


def checkpoint_policy(checkpoint: str | Path, family, arch, state) -> tuple[torch.nn.Module, Path]:
    """(policy, step dir) of a training checkpoint (its latest step), refused unless the run trained this
    family's model of the folder's arch."""
    step_dir, _ = find_step(checkpoint)
    cfg = read_run_config(step_dir)
    if cfg.model.family_impl is not family:
        raise GenerateError(f"--checkpoint {step_dir} trained a {cfg.model.family!r} model; --model is a "
                            f"{family.name!r} folder")
    ours, theirs = family.arch_to_config(arch), family.arch_to_config(cfg.model.arch)
    diff = sorted(k for k in ours.keys() | theirs.keys() if not k.startswith("_") and ours.get(k) != theirs.get(k))
    if diff:
        raise GenerateError(f"--checkpoint {step_dir} holds another transformer than --model's: "
                            + ", ".join(f"{k}={theirs.get(k)!r} (model: {ours.get(k)!r})" for k in diff[:4]))
    return load_policy(step_dir, cfg, state), step_dir
