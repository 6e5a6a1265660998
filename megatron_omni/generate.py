"""``megatron-omni generate``: a batch job sampling one PNG per prompt line from a diffusers pipeline folder's model,
optionally with a LoRA folder or a training checkpoint on it, exactly as the pipeline itself samples.

    megatron-omni generate --model Qwen-Image --prompts prompts.txt --out samples/base
    megatron-omni generate --model Qwen-Image --lora exports/ocr_lora --prompts eval.jsonl --out samples/ocr
    torchrun --nproc-per-node 8 -m megatron_omni.cli generate --model Qwen-Image --checkpoint runs/ocr \\
        --prompts eval.txt --out samples/ocr_step300

Line i of the prompt file is sampled with seed S + i (a JSONL line's own ``"seed"`` / ``"negative_prompt"`` win):
its initial latents are what the pipeline draws from ``torch.Generator().manual_seed(seed)``, then Euler steps
over the pipeline's own sigma schedule.  True CFG runs when the pipeline's ``__call__`` runs it: a negative prompt
is given (an empty one counts) and the scale is > 1 (an SD3 folder: whenever the scale is > 1, as
``StableDiffusion3Pipeline``, the negative prompt "" unless one is given).  So in float32 an image is the pipeline's ``pipe(prompt,
negative_prompt=..., true_cfg_scale=G, height=H, width=W, num_inference_steps=N, generator=...)`` image; the
defaults are that call's (50 steps, scale 4, no negative prompt, 1024 x 1024 = QwenImagePipeline's
default_sample_size 128 x VAE factor 8).

An edit folder (``QwenImageEditPipeline``) takes a JSONL prompt file with ``"prompt"`` (the instruction) and
``"image"`` (the source image's path, relative to the JSONL) per line, and samples as that pipeline's ``pipe(image,
prompt, negative_prompt=..., true_cfg_scale=G, num_inference_steps=N, generator=...)`` at its default size: the
source resized to about 1 MP (each side a multiple of 32), the output that size; the text encoder sees the
resized source with the instruction (and with the negative prompt), and the source's VAE latents follow the
sampled tokens in every forward as their own RoPE frame.  ``--height`` / ``--width`` other than that size are
refused.

``--out`` receives ``NNNNN.png`` per line, ``manifest.jsonl`` (a JSON object per finished line: index, prompt,
negative_prompt, seed, file, height, width, steps, guidance, dtype and the weights' sources) and
``contact_sheet.png`` (the first lines' images, labelled).  A rerun skips the lines the manifest lists with the
same entry whose PNG exists.  Under torchrun (data parallel, one model per rank) rank r samples the lines i = r
(mod world) and appends each finished line to ``manifest.part<r>.jsonl``; after a barrier rank 0 merges the
parts into ``manifest.jsonl`` (parts an interrupted run left count as finished) and draws the contact sheet.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from megatron_omni.data.prompts import PromptDataset
from megatron_omni.generate_weights import GenerateError, attach_lora, checkpoint_policy, folder_denoiser

PROG = "megatron-omni generate"
DEFAULT_SIZE = 1024  # QwenImagePipeline's default height and width (default_sample_size 128 x VAE factor 8)
MANIFEST, SHEET, PART = "manifest.jsonl", "contact_sheet.png", "manifest.part{rank}.jsonl"
SHEET_MAX, SHEET_TILE = 64, 256  # the contact sheet shows the first 64 lines, tiles at most 256 px wide
# barrier timeout: rank 0 waits at the end for the slowest rank (whose lines a rerun may not have skipped)
TIMEOUT_S = 24 * 3600.0


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """The sampling settings; defaults are QwenImagePipeline.__call__'s (see the module docstring)."""

    height: int | None = None  # None: DEFAULT_SIZE, or an edit's source size (the only one an edit takes)
    width: int | None = None
    steps: int = 50
    guidance: float = 4.0  # CFG scale (QwenImagePipeline's true_cfg_scale, there only with a negative prompt)
    negative_prompt: str | None = None  # for every line without its own; None: no CFG (SD3: CFG against "")
    seed: int = 0  # line i's seed is seed + i
    batch_size: int = 1  # requests per forward (CFG doubles the rows); never changes a sample
    dtype: str = "bfloat16"
    device: str = "auto"

    def check(self) -> None:
        for name in ("height", "width", "steps", "batch_size"):
            value = getattr(self, name)
            if value is None and name in ("height", "width"):
                continue
            if not isinstance(value, int) or value < 1:
                raise GenerateError(f"--{name.replace('_', '-')} {value!r}: expected an integer >= 1")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise GenerateError(f"--seed {self.seed!r}: expected an integer >= 0")
        if self.dtype not in ("float32", "bfloat16"):
            raise GenerateError(f"--dtype {self.dtype!r}: expected float32 or bfloat16")


@dataclasses.dataclass
class GenerateResult:
    out: Path
    total: int  # lines in the prompt file
    skipped: int  # lines finished by an earlier run (all ranks)
    generated: list[int] = dataclasses.field(default_factory=list)  # line indices this rank sampled
    # keep_images: index -> this rank's image [3, H, W] in [0, 1], as decoded (before the PNG's rounding)
    images: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


# ---- the lines to sample -------------------------------------------------------------------------------------

def plan_lines(dataset: PromptDataset, options: GenerateOptions, sources: dict[str, str | None],
               edit_size=None) -> list[dict]:
    """The manifest entry of every line: what makes its image (a rerun skips a line whose entry is unchanged).
    ``edit_size(source image size (w, h)) -> (height, width)``: an edit folder's output size (then the records
    are EditDataset's and each entry names its source image)."""
    entries = []
    for i, record in enumerate(dataset):
        negative = record.negative_prompt if record.negative_prompt is not None else options.negative_prompt
        entry = {"index": i, "prompt": record.prompt, "negative_prompt": negative,
                 "seed": record.seed if record.seed is not None else options.seed + i, "file": f"{i:05d}.png",
                 "height": options.height or DEFAULT_SIZE, "width": options.width or DEFAULT_SIZE,
                 "steps": options.steps, "guidance": float(options.guidance), "dtype": options.dtype, **sources}
        if edit_size is not None:
            entry.update(_edit_entry(dataset, record, options, edit_size))
        entries.append(entry)
    return entries


def _edit_entry(dataset, record, options: GenerateOptions, edit_size) -> dict:
    """An edit line's source image and output size (the pipeline's default for that source; no other)."""
    from PIL import Image, UnidentifiedImageError

    where = f"{dataset.source}:{record.line}" if record.line is not None else f"{dataset.source}"
    try:
        with Image.open(record.image_path) as image:
            size = image.size
    except (OSError, UnidentifiedImageError) as err:
        raise GenerateError(f"{where}: image {record.image_path} cannot be read: {err}; expected an image file PIL "
                            f"opens (PNG, JPEG, WebP...)") from None
    height, width = edit_size(size)
    if (options.height or height, options.width or width) != (height, width):
        raise GenerateError(f"{where}: --height {options.height} --width {options.width} for the source image "
                            f"{record.image_path} ({size[0]}x{size[1]}): an edit samples at the source's size "
                            f"resized to ~1 MP, {height}x{width} (height x width) here, as QwenImageEditPipeline's "
                            f"default; leave --height / --width out")
    return {"image": str(record.image_path), "height": height, "width": width}


def read_records(out: Path) -> dict[int, dict]:
    """index -> entry of ``manifest.jsonl``, then of the rank parts (later wins); unreadable lines are ignored
    (a line cut by an interrupted run is simply not finished)."""
    records: dict[int, dict] = {}
    for path in [out / MANIFEST, *sorted(out.glob(PART.format(rank="*")))]:
        if not path.is_file():
            continue
        for text in path.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(entry, dict) and isinstance(entry.get("index"), int):
                records[entry["index"]] = entry
    return records


def finished(out: Path, plan: list[dict]) -> list[dict]:
    """The planned lines an earlier run finished: the same entry recorded, and its PNG there."""
    records = read_records(out)
    return [e for e in plan if records.get(e["index"]) == e and (out / e["file"]).is_file()]


# ---- the model ----------------------------------------------------------------------------------------------

def pipeline_family(model: str | Path):
    """(family, pipeline class name) of a diffusers pipeline folder, refusing classes no family loads."""
    from model_specs.family import family_for_class

    index = Path(model) / "model_index.json"
    if not index.is_file():
        raise GenerateError(f"--model {model}: {index} is missing; expected a diffusers pipeline folder "
                            f"(save_pretrained), e.g. a QwenImagePipeline")
    class_name = json.loads(index.read_text()).get("_class_name")
    family = family_for_class(str(class_name))
    if class_name not in family.pipeline_classes:
        raise GenerateError(f"--model {model} is a {class_name!r} folder; expected a pipeline folder of "
                            f"{list(family.pipeline_classes)}")
    return family, class_name


def load_pipeline(model: str | Path, dtype: torch.dtype, device: torch.device):
    """(family, pipeline parts) of a diffusers pipeline folder, refusing other classes."""
    family, _ = pipeline_family(model)
    return family, family.pipeline(model, dtype, device)


def load_prompts(prompts: str | Path | PromptDataset, edit: bool, model, class_name: str) -> PromptDataset:
    """The prompt file (or dataset) of the folder: an EditDataset (JSONL with "prompt" and "image") for an edit."""
    from megatron_omni.data.prompts import EditDataset

    if not edit:
        return prompts if isinstance(prompts, PromptDataset) else PromptDataset.from_file(prompts)
    if isinstance(prompts, EditDataset):
        return prompts
    if isinstance(prompts, PromptDataset) or Path(prompts).suffix != ".jsonl":
        raise GenerateError(f"--model {model} is a {class_name} folder: --prompts {prompts} must be a .jsonl file "
                            f'with "prompt" and "image" (the source image\'s path, relative to the file) per line, '
                            f'e.g. {{"prompt": "make the sky green", "image": "images/cat.png"}}')
    return EditDataset.from_file(prompts)


def load_denoiser(family, parts, dtype: torch.dtype, state, lora: str | Path | None = None,
                  checkpoint: str | Path | None = None) -> tuple[torch.nn.Module, Any, dict[str, str | None]]:
    """(denoiser, arch, sources): the folder's transformer, with a LoRA folder's adapters, or a training
    checkpoint's policy on the folder's arch.  ``sources`` names the weights for the manifest."""
    from checkpoints_convert.hf_folder import HFFolder

    folder = HFFolder(parts.transformer_dir)
    try:
        arch = family.arch_from_config(folder.config)
    except ValueError as e:
        raise GenerateError(f"{folder.path / 'config.json'}: {e}") from None
    sources = {"model": str(Path(parts.transformer_dir).parent.resolve()), "lora": None, "checkpoint": None}
    if checkpoint is not None:
        module, step_dir = checkpoint_policy(checkpoint, family, arch, state)
        sources["checkpoint"] = str(step_dir.resolve())
        return module.to(dtype).eval(), arch, sources
    module = folder_denoiser(family, arch, folder, dtype, state)
    if lora is not None:
        attach_lora(module, lora, family, arch)
        sources["lora"] = str(Path(lora).resolve())
    return module.eval(), arch, sources


@contextlib.contextmanager
def parallel(device: str, seed: int) -> Iterator[Any]:
    """megatron's groups over torchrun's world (or this process alone): TP = CP = PP = 1, data parallel only."""
    from megatron_omni.parallel.state import destroy_parallel, init_parallel

    state = init_parallel(seed=seed, device=device, timeout_s=TIMEOUT_S)
    try:
        yield state
    finally:
        destroy_parallel()


@contextlib.contextmanager
def loader_bars(enabled: bool) -> Iterator[None]:
    """transformers' / diffusers' loading progress bars on or off (``--quiet``), restored afterwards."""
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    saved = [(m, m.is_progress_bar_enabled()) for m in (transformers_logging, diffusers_logging)]
    for m, _ in saved:
        (m.enable_progress_bar if enabled else m.disable_progress_bar)()
    try:
        yield
    finally:
        for m, was in saved:
            (m.enable_progress_bar if was else m.disable_progress_bar)()


def barrier(state) -> None:
    if state.world_size > 1:
        torch.distributed.barrier()


# ---- sampling and the outputs --------------------------------------------------------------------------------

def edit_request(entry: dict, parts, family):
    """The ODE request of an edit line: its source image resized and VAE-encoded (``context_latents``), the
    instruction (and the negative prompt, with CFG) encoded with that image, the pipeline's schedule for its grid."""
    from PIL import Image

    with Image.open(entry["image"]) as image:
        image = image.convert("RGB")
    img_fhw, context, resized = parts.edit_inputs(image)
    req = request_for(entry, img_fhw, tuple(parts.sigmas(entry["steps"], img_fhw).tolist()), family)
    texts = [req.prompt] + ([req.negative_prompt] if req.cfg else [])
    emb, mask = parts.encode_edit(texts, [resized] * len(texts))
    req.prompt_emb, req.prompt_mask = emb[0], mask[0]
    if req.cfg:
        req.negative_prompt_emb, req.negative_prompt_mask = emb[1], mask[1]
    req.context_latents = context
    return req


def decode_samples(parts, trajs) -> list[torch.Tensor]:
    """Each trajectory's final sample decoded ([3, H, W] float on the CPU), one decode per token grid."""
    grids: dict[tuple, list[int]] = {}
    for i, t in enumerate(trajs):
        grids.setdefault(tuple(t.request.img_fhw), []).append(i)
    images: list = [None] * len(trajs)
    for img_fhw, idx in grids.items():
        decoded = parts.decode(torch.stack([trajs[i].final_sample for i in idx]), img_fhw).float().cpu()
        for i, image in zip(idx, decoded):
            images[i] = image
    return images


def request_for(entry: dict, img_fhw: tuple[int, int, int], sigmas: tuple[float, ...], family):
    """The ODE request of one line; CFG exactly when the family's pipeline runs it: scale > 1 and, for Qwen-Image, a
    negative prompt (``ModelFamily.cfg_needs_negative_prompt``; SD3's negative is then "")."""
    from megatron_omni.rollout.engine import Request

    negative_given = entry["negative_prompt"] is not None or not family.cfg_needs_negative_prompt
    cfg = negative_given and entry["guidance"] > 1
    return Request(prompt=entry["prompt"], prompt_id=entry["index"], negative_prompt=entry["negative_prompt"] or "",
                   seed=entry["seed"], img_fhw=img_fhw, num_steps=entry["steps"], sigmas=sigmas, sampler="ode",
                   guidance_scale=entry["guidance"] if cfg else 1.0, cfg_rescale=family.guidance_rescale)


def save_png(image_3HW: torch.Tensor, path: Path) -> None:
    """uint8 as diffusers' output_type="pil" rounds (round(x * 255)), written atomically."""
    from PIL import Image

    from megatron_omni.logging.grids import as_uint8_NHWC

    tmp = path.with_name(f".{path.name}.tmp")
    Image.fromarray(as_uint8_NHWC(image_3HW[None])[0]).save(tmp, format="PNG")
    os.replace(tmp, path)


def sample_lines(engine, parts, family, todo: list[dict], out: Path, state, options: GenerateOptions,
                 progress: bool, keep_images: bool) -> dict[int, torch.Tensor]:
    """Sample ``todo`` in batches; each image's PNG, then its entry in this rank's manifest part."""
    from tqdm import tqdm

    if not parts.edit:
        img_fhw = parts.latent_grid(options.height or DEFAULT_SIZE, options.width or DEFAULT_SIZE)
        sigmas = tuple(parts.sigmas(options.steps, img_fhw).tolist())
    kept = {}
    bar = tqdm(total=len(todo), desc="generate", unit="image", disable=not progress or state.rank != 0)
    with open(out / PART.format(rank=state.rank), "a", encoding="utf-8") as part, bar:
        for start in range(0, len(todo), options.batch_size):
            chunk = todo[start:start + options.batch_size]
            requests = [edit_request(e, parts, family) if parts.edit else request_for(e, img_fhw, sigmas, family)
                        for e in chunk]
            images = decode_samples(parts, engine.generate(requests))
            for entry, image in zip(chunk, images):
                save_png(image, out / entry["file"])
                part.write(json.dumps(entry) + "\n")
                part.flush()
                if keep_images:
                    kept[entry["index"]] = image
            bar.update(len(chunk))
    return kept


def write_outputs(out: Path, plan: list[dict]) -> list[dict]:
    """Rank 0, after every rank is done: manifest.jsonl of the finished lines (atomically, the parts removed) and
    the contact sheet.  Returns the finished entries."""
    done = finished(out, plan)
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text("".join(json.dumps(e) + "\n" for e in done), encoding="utf-8")
    os.replace(tmp, out / MANIFEST)
    for part in out.glob(PART.format(rank="*")):
        part.unlink()
    if done:
        contact_sheet(out, done[:SHEET_MAX])
    return done


def contact_sheet(out: Path, entries: list[dict]) -> Path:
    """The entries' PNGs as one labelled grid (prompt, then seed), tiles at most SHEET_TILE px wide."""
    import numpy as np
    from PIL import Image

    from megatron_omni.logging.grids import labelled_grid

    tiles = []
    for e in entries:
        with Image.open(out / e["file"]) as image:
            image = image.convert("RGB")
            if image.width > SHEET_TILE:
                image = image.resize((SHEET_TILE, round(image.height * SHEET_TILE / image.width)), Image.LANCZOS)
            tiles.append(torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255)
    if len({t.shape for t in tiles}) > 1:  # edits of several aspect ratios: tiles padded (black) to the largest
        height, width = max(t.shape[1] for t in tiles), max(t.shape[2] for t in tiles)
        tiles = [torch.nn.functional.pad(t, (0, width - t.shape[2], 0, height - t.shape[1])) for t in tiles]
    labels = [f"{e['prompt']}\nseed {e['seed']}" for e in entries]
    return labelled_grid(torch.stack(tiles), labels, out / SHEET)


# ---- the job -------------------------------------------------------------------------------------------------

def generate(model: str | Path, prompts: str | Path | PromptDataset, out: str | Path, *,
             lora: str | Path | None = None, checkpoint: str | Path | None = None,
             options: GenerateOptions = GenerateOptions(), progress: bool = True,
             keep_images: bool = False) -> GenerateResult:
    """Sample every line of ``prompts`` not finished in ``out`` (see the module docstring).  Every input is
    checked before anything is written; ``keep_images`` returns this rank's images as floats (pre-PNG)."""
    from megatron_omni.rollout.config import EngineConfig
    from megatron_omni.rollout.engine import EmbeddedEngine
    from model_specs.common.dtypes import DTYPES

    start = time.perf_counter()
    if lora is not None and checkpoint is not None:
        raise GenerateError(f"--lora {lora} and --checkpoint {checkpoint}: give one of them (a LoRA folder or a "
                            f"training checkpoint), not both")
    options.check()
    family, class_name = pipeline_family(model)
    edit = class_name in family.edit_pipeline_classes
    dataset = load_prompts(prompts, edit, model, class_name)
    out, dtype = Path(out), DTYPES[options.dtype]
    if out.exists() and not out.is_dir():
        raise GenerateError(f"--out {out} is a file; expected a folder (created if missing)")
    with parallel(options.device, options.seed) as state, loader_bars(progress and state.rank == 0):
        family, parts = load_pipeline(model, dtype, state.torch_device)
        if not edit:  # refuses a size the VAE cannot make
            parts.latent_grid(options.height or DEFAULT_SIZE, options.width or DEFAULT_SIZE)
        module, arch, sources = load_denoiser(family, parts, dtype, state, lora, checkpoint)
        # an edit's requests carry their text embeddings (encoded with the source image)
        engine = EmbeddedEngine(module, arch, None if edit else parts.encode,
                                EngineConfig(max_num_seqs=options.batch_size), initial_noise=parts.noise)
        plan = plan_lines(dataset, options, sources, parts.edit_size if edit else None)
        skipped = {e["index"] for e in finished(out, plan)}
        barrier(state)  # every rank has read what an earlier run left before any rank writes
        out.mkdir(parents=True, exist_ok=True)
        todo = [e for e in plan if e["index"] % state.world_size == state.rank and e["index"] not in skipped]
        if state.rank == 0:
            print(f"{PROG}: {len(plan)} lines: {len(skipped)} skipped (in {out / MANIFEST} with their PNGs), "
                  f"{len(plan) - len(skipped)} to sample on {state.world_size} rank(s)", file=sys.stderr)
        kept = sample_lines(engine, parts, family, todo, out, state, options, progress, keep_images)
        barrier(state)
        if state.rank == 0 and len(write_outputs(out, plan)) < len(plan):
            raise GenerateError(f"{out / MANIFEST} lists fewer lines than {len(plan)}: a rank's PNGs are missing")
    return GenerateResult(out, len(plan), len(skipped), [e["index"] for e in todo], kept,
                          time.perf_counter() - start)


# the sampling flags: (flag, type, metavar, help); defaults are GenerateOptions'
SETTINGS = (("--height", int, "H", f"image height in pixels (default: {DEFAULT_SIZE}; an edit: its source's ~1 MP size, the only "
                                   f"one it takes), e.g. --height 512"),
            ("--width", int, "W", f"image width in pixels (default: {DEFAULT_SIZE}; an edit: its source's), e.g. --width 768"),
            ("--steps", int, "N", "sampling steps, e.g. --steps 30"),
            ("--guidance", float, "G", "CFG scale; Qwen-Image: true CFG, applied only with a negative prompt; SD3: "
                                       "CFG whenever > 1 (1 turns it off), e.g. --guidance 5"),
            ("--negative-prompt", str, "TEXT", "negative prompt of the lines without their own; Qwen-Image: without "
                                               "one there is no CFG (the pipeline's rule); SD3: \"\" when none is "
                                               "given, e.g. --negative-prompt ' '"),
            ("--seed", int, "S", "line i uses seed S + i (a JSONL line's \"seed\" wins), e.g. --seed 42"),
            ("--batch-size", int, "B", "lines per forward (does not change an image), e.g. --batch-size 8"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Sample one PNG per prompt line from a diffusers pipeline folder's model (optionally a LoRA\n"
                    "folder or a training checkpoint on it), as the pipeline samples at the same seed; writes\n"
                    "NNNNN.png, manifest.jsonl and contact_sheet.png into --out.  A rerun skips finished lines.\n"
                    "Under torchrun every rank samples its share of the lines (data parallel).",
        epilog="examples:\n  megatron-omni generate --model Qwen-Image --prompts prompts.txt --out samples/base\n"
               "  megatron-omni generate --model Qwen-Image --lora exports/ocr_lora --prompts eval.jsonl \\\n"
               "      --out samples/ocr --steps 30 --negative-prompt ' ' --seed 42 --batch-size 4\n"
               "  torchrun --nproc-per-node 8 -m megatron_omni.cli generate --model Qwen-Image \\\n"
               "      --checkpoint runs/ocr --prompts eval.txt --out samples/ocr_step300")
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a diffusers pipeline folder (model_index.json), e.g. --model Qwen-Image")
    weights = p.add_argument_group("weights on the folder's model (at most one)")
    weights.add_argument("--lora", metavar="DIR", help="a diffusers LoRA folder (pytorch_lora_weights.safetensors, "
                         "as `megatron-omni export` writes), e.g. --lora exports/ocr_lora")
    weights.add_argument("--checkpoint", metavar="DIR", help="a training run dir, its checkpoints/ dir or a step "
                         "dir; the policy of its latest step, e.g. --checkpoint runs/ocr")
    p.add_argument("--prompts", required=True, metavar="FILE", help=".txt (a prompt per line) or .jsonl (\"prompt\", "
                   "optional \"negative_prompt\" and \"seed\" per line; an edit folder: .jsonl with \"prompt\" and "
                   "\"image\", a path relative to the file), e.g. --prompts eval.jsonl")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder, created if missing; a rerun into it "
                   "skips finished lines, e.g. --out samples/base")
    defaults = GenerateOptions()
    for flag, kind, metavar, what in SETTINGS:
        default = getattr(defaults, flag[2:].replace("-", "_"))
        p.add_argument(flag, type=kind, metavar=metavar, default=default,
                       help=what if flag in ("--height", "--width") else  # their help names the default
                       f"{what} (default: {'none' if default is None else default})")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=defaults.dtype,
                   help=f"model, text encoder and VAE dtype, e.g. --dtype float32 (default: {defaults.dtype})")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=defaults.device,
                   help=f"auto: CUDA when present, e.g. --device cpu (default: {defaults.device})")
    p.add_argument("--quiet", action="store_true", help="no progress bars (sampling, model loading), e.g. --quiet")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = GenerateOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(GenerateOptions)})
    try:
        done = generate(args.model, args.prompts, args.out, lora=args.lora, checkpoint=args.checkpoint,
                        options=options, progress=not args.quiet)
    except (ValueError, FileNotFoundError) as e:  # GenerateError, DatasetError, ConversionError, ExportError...
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"wrote {done.total - done.skipped} images ({done.skipped} skipped) and {MANIFEST}, {SHEET} to "
              f"{done.out} in {done.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
