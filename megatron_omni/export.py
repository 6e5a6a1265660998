"""``megatron-omni export``: a training checkpoint as a folder diffusers loads.

    megatron-omni export --checkpoint runs/digits --out exports/digits_lora            # LoRA runs
    megatron-omni export --checkpoint runs/digits --out exports/digits_full --merged   # any run

A LoRA folder holds ``pytorch_lora_weights.safetensors`` in diffusers' peft format, what its
``save_lora_weights`` writes and ``pipe.load_lora_weights(DIR)`` reads: keys
``transformer.<diffusers module>.lora_A.weight`` [r, in] and ``.lora_B.weight`` [out, r], and the safetensors
metadata entry ``lora_adapter_metadata``: JSON ``{"transformer.r": r, "transformer.lora_alpha": alpha,
"transformer.target_modules": [...], ...}``, the peft ``LoraConfig`` diffusers builds the adapter from.  Without
it diffusers infers the rank from the tensors and takes alpha = r, so a run trained with alpha != r would load
at the wrong scale.  A bare transformer reads the folder with ``load_lora_adapter(DIR, prefix="transformer",
use_safetensors=True)`` (without ``use_safetensors`` it looks for a ``.bin`` file).

``--merged`` writes a diffusers transformer folder (config.json + safetensors; ``from_pretrained(DIR)`` of the
family's transformer class): W + alpha/r B A folded into every adapted weight for a LoRA run, the trained
weights as they are for a full fine-tune (the only form such a run has).

The policy is rebuilt in this one process at TP=1 from the step's ``run_config.yaml``; only the model part of
the distributed checkpoint is read (not the optimizer), and dist checkpointing reshards whatever TP wrote it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from checkpoints_convert.hf_folder import ConversionError, atomic_output_dir, write_hf_folder
from megatron_omni.config import ConfigError, load_config
from megatron_omni.config.schema import RunConfig
from megatron_omni.trainer.checkpoint import RUN_CONFIG

PROG = "megatron-omni export"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # the file name diffusers' load_lora_weights looks for first
LORA_METADATA_KEY = "lora_adapter_metadata"  # diffusers' safetensors metadata key of the LoraConfig
_STEP_DIR = re.compile(r"step_(\d+)")


class ExportError(ValueError):
    """A checkpoint, step or output the export cannot use: one clear message, nothing written."""


# ---- which checkpoint ----------------------------------------------------------------------------------------

def find_step(checkpoint: str | Path, step: int | None = None) -> tuple[Path, int | None]:
    """(step folder, step) of ``checkpoint``: a run dir (``train.output_dir``), its ``checkpoints/`` dir, or one
    ``step_NNNNNN/`` dir.  ``step`` picks a step (default: the one ``checkpoints/latest`` names)."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise ExportError(f"--checkpoint {path} is not a directory; expected a run dir, its checkpoints/ dir or "
                          f"a checkpoints/step_NNNNNN/ dir")
    if (path / RUN_CONFIG).is_file():  # one step's folder
        match = _STEP_DIR.fullmatch(path.name)
        found = int(match.group(1)) if match else None
        if step is not None and step != found:
            raise ExportError(f"--step {step}: {path} is the folder of step {found}; give its checkpoints/ dir "
                              f"to pick another step")
        return path, found
    root = path / "checkpoints" if (path / "checkpoints" / "latest").is_file() else path
    if not (root / "latest").is_file():
        raise ExportError(f"--checkpoint {path} is not a training checkpoint: it holds no checkpoints/latest, no "
                          f"latest and no {RUN_CONFIG}; expected a run dir, its checkpoints/ dir or a step dir")
    steps = {int(m.group(1)): p for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))}
    what = f"--step {step}"
    if step is None:
        text = (root / "latest").read_text().strip()
        if not text.isdigit():
            raise ExportError(f"{root / 'latest'} holds {text!r}; expected a step number")
        step, what = int(text), f"{root / 'latest'} names step {text}"
    if step not in steps:
        raise ExportError(f"{what}: no checkpoint of that step under {root}; it holds steps {sorted(steps)}")
    if not (steps[step] / RUN_CONFIG).is_file():
        raise ExportError(f"{steps[step]} has no {RUN_CONFIG} (written by an older trainer); expected the resolved "
                          f"run config beside the checkpoint")
    return steps[step], step


def read_run_config(step_dir: Path) -> RunConfig:
    """The resolved run config that trained the checkpoint in ``step_dir``."""
    if not (step_dir / "metadata.json").is_file():
        raise ExportError(f"{step_dir} is not a megatron-core distributed checkpoint (no metadata.json)")
    try:
        return load_config(None, str(step_dir / RUN_CONFIG), [])
    except ConfigError as e:
        raise ExportError(f"{step_dir / RUN_CONFIG}: {e}") from None


# ---- the policy at that step ---------------------------------------------------------------------------------

@contextlib.contextmanager
def single_rank(seed: int) -> Iterator[Any]:
    """megatron's parallel groups for this process alone (TP = CP = PP = 1, on CUDA if present), torn down after."""
    from megatron_omni.parallel.state import destroy_parallel, init_parallel

    state = init_parallel(seed=seed, device="auto")
    try:
        yield state
    finally:
        destroy_parallel()


def build_policy_module(cfg: RunConfig, state) -> torch.nn.Module:
    """The run's denoiser at ``state``'s TP (PP = CP = 1), with its LoRA adapters attached for a LoRA run (values
    not initialised: they are loaded next)."""
    from model_specs.common.lora import apply_lora

    family, arch = cfg.model.family_impl, cfg.model.arch
    config = family.transformer_config(arch, state.tp, params_dtype=cfg.model.torch_dtype,
                                       perform_initialization=False)
    module = family.build(arch, config, state.tp_group, cfg.model.backend).to(state.torch_device)
    if cfg.lora.rank > 0:
        apply_lora(module, cfg.lora.rank, cfg.lora.alpha or cfg.lora.rank, cfg.lora_targets, family.rules(arch),
                   seed=cfg.train.seed)
    return module


def load_policy(step_dir: Path, cfg: RunConfig, state) -> torch.nn.Module:
    """The policy of ``step_dir`` (base weights and adapters) at ``state``'s TP, whatever TP wrote it (dist
    checkpointing reads the slices this layout needs), reading only the model's tensors of the checkpoint.

    Requested keys the checkpoint lacks are an error (``RAISE_UNEXPECTED``); the optimizer state it also holds is
    "missing" in megatron's terms and skipped.  Checkpoint keys are the plain model's names (``LoRALinear`` drops
    its ``.base`` hop), under ``module.`` when the trainer saved megatron's DDP wrapper; the loaded tensors are
    renamed to the module's own before ``load_state_dict``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from megatron_omni.parallel.cpu_compat import apply_cpu_compat, cuda_factories_on_cpu
    from model_specs.common.lora import target_name

    module = build_policy_module(cfg, state)
    apply_cpu_compat()
    prefix = _key_prefix(step_dir)
    request = {k: v for k, v in module.sharded_state_dict(prefix=prefix).items() if not k.endswith("_extra_state")}
    try:
        with cuda_factories_on_cpu():
            loaded = dist_checkpointing.load(request, str(step_dir), strict=StrictHandling.RAISE_UNEXPECTED)
    except CheckpointingException as e:
        raise ExportError(f"{step_dir} does not hold the model its {RUN_CONFIG} describes: "
                          f"{' '.join(str(e).split())[:400]}") from None
    own = {target_name(k): k for k in module.state_dict() if not k.endswith("_extra_state")}
    loaded = {k.removeprefix(prefix): v for k, v in loaded.items() if k in request}
    if missing := sorted(set(own) - set(loaded)):
        raise ExportError(f"{step_dir} lacks {len(missing)} model tensor(s), e.g. {missing[:3]}")
    module.load_state_dict({own[k]: v for k, v in loaded.items()}, strict=True)
    return module.eval()


def _key_prefix(step_dir: Path) -> str:
    """``"module."`` when the checkpoint holds megatron's DDP wrapper of the model (as the trainer saves it)."""
    from megatron.core import dist_checkpointing

    keys = dist_checkpointing.load_tensors_metadata(str(step_dir))
    return "module." if any(k.startswith("module.") for k in keys) else ""


# ---- the two output forms ------------------------------------------------------------------------------------

def _exported(exporter, desc: str, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The exporter's (name, tensor) pairs on the CPU, with a progress bar."""
    for name, tensor in tqdm(exporter.tensors(), total=len(exporter.plan()), desc=desc, unit="tensor",
                             disable=not progress):
        yield name, tensor.detach().cpu()


def write_lora_folder(module: torch.nn.Module, folder: Path, prefix: str, progress: bool = True) -> int:
    """``pytorch_lora_weights.safetensors`` with the adapters and their LoraConfig; returns the tensor count."""
    from megatron_omni.sync import HFExporter
    from model_specs.common.lora import lora_modules

    scales = {(m.rank, m.alpha) for m in lora_modules(module).values()}
    if len(scales) != 1:
        raise ExportError(f"the adapters have several (rank, alpha) pairs {sorted(scales)}; expected one")
    (rank, alpha), = scales
    tensors = {f"{prefix}.{name}": t.contiguous()
               for name, t in _exported(HFExporter(module, mode="lora"), "export lora", progress)}
    targets = sorted({name.removeprefix(f"{prefix}.").rsplit(".lora_", 1)[0] for name in tensors})
    # peft's LoraConfig fields, each under the pipeline component's prefix as diffusers' save_lora_weights writes
    lora_config = {"r": rank, "lora_alpha": alpha, "target_modules": targets, "lora_dropout": 0.0,
                   "use_rslora": False, "use_dora": False, "bias": "none"}
    metadata = {"format": "pt", LORA_METADATA_KEY: json.dumps({f"{prefix}.{k}": v for k, v in lora_config.items()},
                                                               indent=2, sort_keys=True)}
    save_file(tensors, str(folder / LORA_WEIGHTS), metadata=metadata)
    return len(tensors)


def write_merged_folder(module: torch.nn.Module, folder: Path, config: dict, progress: bool = True) -> int:
    """A diffusers transformer folder: adapters folded into their weights (W + alpha/r B A), or the weights as
    held when the model has none; returns the tensor count."""
    from megatron_omni.sync import HFExporter
    from model_specs.common.lora import lora_modules

    mode = "merged" if lora_modules(module) else "full"
    exporter = HFExporter(module, mode=mode)
    write_hf_folder(folder, config, _exported(exporter, f"export {mode}", progress))
    return len(exporter.plan())


# ---- the command ---------------------------------------------------------------------------------------------

def export_checkpoint(checkpoint: str | Path, out: str | Path, merged: bool = False, step: int | None = None,
                      progress: bool = True) -> dict[str, Any]:
    """Write the policy of a training checkpoint to ``out`` (a new folder; see the module docstring for the
    forms).  Returns what was written: out, form ("lora" | "merged" | "full"), step, family, tensors, source."""
    step_dir, step = find_step(checkpoint, step)
    cfg = read_run_config(step_dir)
    if not merged and cfg.lora.rank == 0:
        raise ExportError(f"{step_dir} is a full fine-tune (lora.rank=0 in its {RUN_CONFIG}): it has no LoRA "
                          f"adapters to export; use --merged to export the whole transformer")
    family = cfg.model.family_impl
    form = "lora" if not merged else "merged" if cfg.lora.rank > 0 else "full"
    with atomic_output_dir(out) as tmp, single_rank(cfg.train.seed) as state:  # refuses a non-empty out first
        module = load_policy(step_dir, cfg, state)
        if merged:
            n = write_merged_folder(module, tmp, family.arch_to_config(cfg.model.arch), progress)
        else:
            n = write_lora_folder(module, tmp, family.experts[0], progress)
    return {"out": str(out), "form": form, "step": step, "family": family.name, "tensors": n,
            "source": str(step_dir)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Export the policy of a training checkpoint as a diffusers LoRA folder (LoRA runs; "
                    "pipe.load_lora_weights(DIR)),\nor with --merged as a diffusers transformer folder (the "
                    "family's transformer class .from_pretrained(DIR),\ne.g. QwenImageTransformer2DModel). "
                    "One process, no torchrun.",
        epilog="examples:\n  megatron-omni export --checkpoint runs/digits --out exports/digits_lora\n"
               "  megatron-omni export --checkpoint runs/digits/checkpoints --step 20 --out exports/step20 --merged\n"
               "  megatron-omni export --checkpoint runs/digits/checkpoints/step_000020 --out exports/s20_lora")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a training run dir (train.output_dir), its checkpoints/ dir, or one step dir "
                        "checkpoints/step_NNNNNN/; e.g. --checkpoint runs/digits")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="folder to create (must not exist or be empty); written atomically, e.g. --out exports/lora")
    p.add_argument("--merged", action="store_true",
                   help="write a full diffusers transformer folder (config.json + safetensors): W + alpha/r*B*A for "
                        "a LoRA run, the weights for a full fine-tune (lora.rank=0: its only form)")
    p.add_argument("--step", type=int, metavar="N",
                   help="export step N (default: the step checkpoints/latest names); e.g. --step 20")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        done = export_checkpoint(args.checkpoint, args.out, merged=args.merged, step=args.step,
                                 progress=not args.quiet)
    except (ExportError, ConversionError) as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    print(f"wrote {done['out']} ({done['form']}, {done['family']}, step {done['step']}, {done['tensors']} tensors) "
          f"in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
