"""HF (diffusers folder) <-> Megatron distributed checkpoint conversion, driven by the mapping table.

Both directions validate everything before writing anything, and write atomically: on any error
the output path is left as it was.
"""
from __future__ import annotations

import os
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from checkpoints_convert.hf_folder import ConversionError, HFFolder, atomic_output_dir, write_hf_folder
from checkpoints_convert.mapping import Rule, to_hf, to_mcore, tp_shard
from checkpoints_convert.mcore_checkpoint import load_global_tensors, read_meta, save_global_tensors
from model_specs.common.dtypes import DTYPES
from model_specs.family import ModelFamily, family_names, family_of, get_family


def transformer_family(config: dict, source: str) -> ModelFamily:
    """The family whose denoiser ``config``'s ``_class_name`` is (a diffusers transformer folder)."""
    cls_name = config.get("_class_name")
    known = {get_family(n).transformer_class: n for n in family_names()}
    if cls_name not in known:
        raise ConversionError(f"{source}: config.json is for {cls_name!r}, which no model family loads; expected one "
                              f"of {sorted(known)}")
    return get_family(known[cls_name])


def _arch_from(family: ModelFamily, config: dict, source: str, tp: int = 1, pp: int = 1):
    try:
        arch = family.arch_from_config(config)
        family.check_layout(arch, tp)
    except ValueError as e:
        raise ConversionError(f"{source}: {e}") from None
    blocks = family.num_blocks(arch)
    if pp < 1 or pp > blocks:
        raise ConversionError(f"pipeline-parallel size {pp} must be between 1 and num_layers={blocks}")
    return arch


def expected_hf_shapes(arch) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the diffusers reference class itself, built on the meta device (no memory)."""
    import diffusers

    family = family_of(arch)
    kwargs = {k: v for k, v in family.arch_to_config(arch).items() if not k.startswith("_")}
    with torch.device("meta"):
        ref = getattr(diffusers, family.transformer_class)(**kwargs)
    return {k: tuple(v.shape) for k, v in ref.state_dict().items()}


def _check_hf_tensors(folder: HFFolder, rules: list[Rule], arch) -> None:
    expected, cls_name = expected_hf_shapes(arch), family_of(arch).transformer_class
    needed = {h for r in rules for h in r.hf}
    assert needed == set(expected), "mapping table out of step with diffusers' parameter names"
    present = set(folder.keys())
    if missing := sorted(needed - present):
        raise ConversionError(f"{folder.path} lacks {len(missing)} tensor(s) of {cls_name}, "
                              f"e.g. {missing[:3]}")
    if unexpected := sorted(present - needed):
        raise ConversionError(f"{folder.path} has {len(unexpected)} tensor(s) unknown to {cls_name}, "
                              f"e.g. {unexpected[:3]}")
    for name in sorted(needed):
        if folder.shape(name) != expected[name]:
            raise ConversionError(f"tensor {name!r} in {folder.path} has shape {folder.shape(name)}; "
                                  f"expected {expected[name]} for the config.json given")


def mcore_state_from_hf(arch, hf_get: Callable[[str], torch.Tensor], tp_rank: int = 0,
                        tp_size: int = 1) -> dict[str, torch.Tensor]:
    """The state dict of one TP rank's denoiser of ``arch``'s family from HF tensors (``hf_get(name)``)."""
    family = family_of(arch)
    heads = family.num_heads(arch)
    return {r.mcore: tp_shard(to_mcore(r, hf_get, heads), r.tp_dim, tp_rank, tp_size) for r in family.rules(arch)}


def hf_to_mcore(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, tp: int = 1, pp: int = 1,
                dtype: str | None = None, progress: bool = True) -> dict:
    """Convert a diffusers transformer folder into a Megatron distributed checkpoint.

    ``tp`` / ``pp`` are validated against the architecture and recorded as the intended layout; the
    stored tensors are global, so the checkpoint also loads at any other valid TP / PP.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    folder = HFFolder(hf_dir)
    source = str(folder.path / "config.json")
    family = transformer_family(folder.config, source)
    arch = _arch_from(family, folder.config, source, tp, pp)
    rules = family.rules(arch)
    _check_hf_tensors(folder, rules, arch)
    tensors = {}
    for rule in tqdm(rules, desc="hf -> mcore", unit="tensor", disable=not progress):
        t = to_mcore(rule, folder.get, family.num_heads(arch))
        tensors[rule.mcore] = t.to(DTYPES[dtype]) if dtype else t
    meta = {"family": family.name, "arch": family.arch_to_config(arch), "tp": tp, "pp": pp,
            "dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch.")}
    with atomic_output_dir(out_dir) as tmp:
        save_global_tensors(tmp, tensors, meta)
    return meta


def hf_state_from_mcore(arch, mcore_get: Callable[[str], torch.Tensor],
                        progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors, in table order, from global (unsharded) Megatron tensors (``mcore_get(name)``)."""
    family = family_of(arch)
    for rule in tqdm(family.rules(arch), desc="mcore -> hf", unit="tensor", disable=not progress):
        yield from to_hf(rule, mcore_get(rule.mcore), family.num_heads(arch))


def mcore_to_hf(mcore_dir: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True,
                max_shard_bytes: int | None = None) -> dict:
    """Convert a Megatron distributed checkpoint (any TP / PP it was written at) to a diffusers folder."""
    meta = read_meta(mcore_dir)
    if meta.get("family") not in family_names():
        raise ConversionError(f"{mcore_dir} holds model family {meta.get('family')!r}; expected one of "
                              f"{family_names()}")
    family = get_family(meta["family"])
    arch = _arch_from(family, meta["arch"], f"{mcore_dir} (megatron_omni metadata)")
    rules = family.rules(arch)
    tensors = load_global_tensors(mcore_dir)
    needed = {r.mcore for r in rules}
    if missing := sorted(needed - set(tensors)):
        raise ConversionError(f"{mcore_dir} lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    expected = expected_hf_shapes(arch)
    with atomic_output_dir(out_dir) as tmp:
        kwargs = {"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}
        pairs = _checked(hf_state_from_mcore(arch, tensors.__getitem__, progress), expected, mcore_dir)
        write_hf_folder(tmp, family.arch_to_config(arch), pairs, **kwargs)
    return meta


def _checked(pairs, expected, source) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in pairs:
        if tuple(t.shape) != expected[name]:
            raise ConversionError(f"tensor {name!r} from {source} has shape {tuple(t.shape)}; expected "
                                  f"{expected[name]}")
        yield name, t
