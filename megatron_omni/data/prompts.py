"""Prompt and edit datasets read from files, their held-out eval split, and the packaged OCR prompts.

The formats a user hands a run (every error a file can cause names the file and its 1-based line):

- ``.txt``: one prompt per non-empty line, kept verbatim but for the whitespace around it (double quotes
  included: the OCR reward reads its target text from them, ``megatron_omni.rewards.ocr.ocr_target``);
- ``.jsonl``: one JSON object per non-empty line: ``"prompt"`` (a non-empty string, required), optional
  ``"negative_prompt"`` (a string) and ``"seed"`` (an integer >= 0).  A ``"metadata"`` object and every other
  field are kept in the record's ``metadata``, which a reward receives beside the prompts;
- edits (:class:`EditDataset`): JSONL as above plus ``"image"``, the source image's path (relative to the
  JSONL's folder), checked to exist when the file is loaded and read only when asked for.

A step's prompts are drawn from (seed, step) as the RL loop draws them (:meth:`PromptDataset.sample`);
:func:`split` holds out an eval set that never shares a prompt with the training set.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch
from PIL import Image, UnidentifiedImageError


def request_seed(seed: int, step: int, index: int) -> int:
    """The seed of draw ``index`` of RL step ``step`` (-1: the step's prompt draw): a function of (seed, step,
    index) only, so a resumed run draws exactly what an uninterrupted one would."""
    return (seed * 1_000_003 + step * 10_007 + index) % (2**63)

_FIELDS = ("prompt", "negative_prompt", "seed", "metadata")  # every other JSONL field goes to metadata
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean"}
_EXAMPLE = '{"prompt": "a shop sign reading \\"Open Late\\"", "negative_prompt": "blurry", "seed": 7}'


class DatasetError(ValueError):
    """A prompt or edit file that cannot be read: the message names the file, the line and the bad value."""


class DatasetFileMissing(DatasetError, FileNotFoundError):
    """A dataset file or an edit's source image that does not exist (a ValueError and a FileNotFoundError)."""


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    prompt: str
    negative_prompt: str | None = None
    seed: int | None = None  # a fixed sampling seed for this prompt (eval), None: the run's seeds
    metadata: dict[str, Any] = field(default_factory=dict)
    line: int | None = None  # 1-based line in the source file; None when built in memory

    def split_key(self) -> str:
        """What makes two records the same prompt, so that :func:`split` keeps them on one side."""
        return self.prompt


@dataclass(frozen=True, kw_only=True)
class EditRecord(PromptRecord):
    image_path: Path  # resolved against the JSONL's folder, checked to exist at load
    image_ref: str  # the path as written in the file: the split key, so a moved folder splits alike

    def split_key(self) -> str:
        return f"{self.prompt}\0{self.image_ref}"  # an edit is its (instruction, source image) pair

    def load_image(self) -> Image.Image:
        """The source image as PIL RGB, read now."""
        try:
            with Image.open(self.image_path) as image:
                return image.convert("RGB")
        except (OSError, UnidentifiedImageError) as err:
            raise DatasetError(f"image {self.image_path} (line {self.line}) cannot be read: {err}; expected "
                               f"an image file PIL opens (PNG, JPEG, WebP...)") from None


Dataset = TypeVar("Dataset", bound="PromptDataset")


class PromptDataset:
    """An ordered, non-empty list of :class:`PromptRecord` with the prompts, negative prompts and metadata
    lists the rollout and the rewards take."""

    suffixes: tuple[str, ...] = (".txt", ".jsonl")

    def __init__(self, records: Sequence[PromptRecord], source: str = "<in memory>"):
        if not records:
            raise DatasetError(f"{source}: no prompts; expected at least one")
        self.records, self.source = list(records), source

    @classmethod
    def from_prompts(cls, prompts: Sequence[str], source: str = "<in memory>") -> "PromptDataset":
        return cls([PromptRecord(prompt=p) for p in prompts], source)

    @classmethod
    def from_file(cls: type[Dataset], path: str | Path, check: Callable[[str], object] | None = None) -> Dataset:
        """Read a .txt or .jsonl file (see the module docstring).  ``check(prompt)`` may raise ValueError to
        refuse a prompt (e.g. ``ocr_target``: the prompt must quote a text); its message gets the line."""
        path = _existing_file(path, cls.suffixes)
        records = []
        for line, text in _lines(path):
            where = f"{path}:{line}"
            is_json = path.suffix == ".jsonl"
            record = cls._parse(path, line, text) if is_json else PromptRecord(prompt=text, line=line)
            if check is not None:
                try:
                    check(record.prompt)
                except ValueError as err:
                    raise DatasetError(f"{where}: {err}") from None
            records.append(record)
        if not records:
            raise DatasetError(f"{path}: no prompts (the file is empty or holds only blank lines); expected "
                               f"one prompt per line")
        return cls(records, str(path))

    @classmethod
    def _parse(cls, path: Path, line: int, text: str) -> PromptRecord:
        return PromptRecord(line=line, **_prompt_fields(f"{path}:{line}", _json_object(f"{path}:{line}", text)))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> PromptRecord:
        return self.records[index]

    def __iter__(self) -> Iterator[PromptRecord]:
        return iter(self.records)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} prompts from {self.source})"

    @property
    def prompts(self) -> list[str]:
        return [r.prompt for r in self.records]

    @property
    def negative_prompts(self) -> list[str | None]:
        return [r.negative_prompt for r in self.records]

    @property
    def metadata(self) -> list[dict[str, Any]]:
        return [r.metadata for r in self.records]

    def subset(self: Dataset, indices: Sequence[int]) -> Dataset:
        return type(self)([self.records[i] for i in indices], self.source)

    def sample(self, step: int, seed: int, n: int) -> list[PromptRecord]:
        """The ``n`` records of RL step ``step``, drawn with replacement from (``seed``, ``step``) exactly as
        FlowGRPO's ``requests`` draws a step's prompts from its task."""
        if n < 1:
            raise ValueError(f"n={n!r}: expected the number of prompts to draw, >= 1")
        g = torch.Generator().manual_seed(request_seed(seed, step, -1))
        picks = torch.randint(0, len(self.records), (n,), generator=g).tolist()
        return [self.records[i] for i in picks]


class EditDataset(PromptDataset):
    """Edit instructions with their source images (JSONL with ``"prompt"`` and ``"image"``), images read
    lazily: :meth:`image` or ``record.load_image()``."""

    suffixes = (".jsonl",)

    @classmethod
    def _parse(cls, path: Path, line: int, text: str) -> EditRecord:
        where = f"{path}:{line}"
        obj = _json_object(where, text)
        ref = obj.get("image")
        if not isinstance(ref, str) or not ref.strip():
            raise DatasetError(f'{where}: "image" is {_describe_field(obj, "image")}; expected the source '
                               f'image\'s path as a string (relative to {path.parent}), e.g. '
                               f'{{"prompt": "make it red", "image": "images/cat.png"}}')
        image = (path.parent / ref).resolve()
        if not image.is_file():
            raise DatasetFileMissing(f"{where}: image {ref!r} does not exist (looked for {image}); expected an "
                                     f"image file, relative paths taken from the JSONL's folder {path.parent}")
        fields = _prompt_fields(where, {k: v for k, v in obj.items() if k != "image"})
        return EditRecord(line=line, image_path=image, image_ref=ref, **fields)

    def image(self, index: int) -> Image.Image:
        return self.records[index].load_image()


@dataclass(frozen=True)
class SplitConfig:
    """How many distinct prompts to hold out for eval (one of the two), and the seed of the permutation."""

    eval_fraction: float | None = None  # of the distinct prompts, rounded, at least 1
    eval_count: int | None = None
    seed: int = 0

    def eval_size(self, distinct: int) -> int:
        """The number of distinct prompts held out, checked to leave at least one for training."""
        if (self.eval_fraction is None) == (self.eval_count is None):
            raise ValueError(f"eval_fraction={self.eval_fraction!r}, eval_count={self.eval_count!r}: expected "
                             f"exactly one of them")
        if self.eval_count is not None:
            if type(self.eval_count) is not int:
                raise ValueError(f"eval_count={self.eval_count!r}: expected an integer number of prompts")
            size = self.eval_count
        elif not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={self.eval_fraction!r}: expected a fraction in (0, 1)")
        else:
            size = max(1, round(self.eval_fraction * distinct))
        if not 1 <= size < distinct:
            raise ValueError(f"eval split of {size} prompts (eval_fraction={self.eval_fraction!r}, eval_count="
                             f"{self.eval_count!r}) out of {distinct} distinct prompts; expected 1 to "
                             f"{distinct - 1}, leaving some to train on")
        return size


def split(dataset: Dataset, eval_fraction: float | None = None, eval_count: int | None = None,
          seed: int = 0) -> tuple[Dataset, Dataset]:
    """(train, eval): a held-out split by distinct prompt (``record.split_key()``), so that no eval prompt
    appears in train.  The distinct prompts are ordered by BLAKE2b(seed, prompt) — a seeded
    permutation that depends on the prompts alone, not on the library versions — and the first ones held out;
    both sides keep the file's order."""
    keys = list(dict.fromkeys(r.split_key() for r in dataset.records))
    size = SplitConfig(eval_fraction, eval_count, seed).eval_size(len(keys))
    held_out = set(sorted(keys, key=lambda k: _seeded_hash(seed, k))[:size])
    is_eval = [r.split_key() in held_out for r in dataset.records]
    return (dataset.subset([i for i, e in enumerate(is_eval) if not e]),
            dataset.subset([i for i, e in enumerate(is_eval) if e]))


def ocr_prompts_path() -> Path:
    """The packaged OCR prompt set: Flow-GRPO's 1,018 text-rendering eval prompts, MIT (its README, LICENSE
    lie beside it)."""
    path = Path(str(resources.files("megatron_omni.data") / "ocr_prompts" / "prompts.txt"))
    if not path.is_file():
        raise DatasetFileMissing(f"the packaged OCR prompts {path} are missing; expected megatron_omni/data/"
                                 f"ocr_prompts/prompts.txt, shipped by setup.py package_data")
    return path


def load_ocr_prompts(path: str | Path | None = None) -> PromptDataset:
    """OCR prompts (default: the packaged set), each line checked to quote the text the OCR reward reads."""
    from megatron_omni.rewards.ocr import ocr_target

    return PromptDataset.from_file(ocr_prompts_path() if path is None else path, check=ocr_target)


def _seeded_hash(seed: int, key: str) -> bytes:
    return hashlib.blake2b(f"{seed}\0{key}".encode("utf-8"), digest_size=16).digest()


def _existing_file(path: str | Path, suffixes: tuple[str, ...]) -> Path:
    path = Path(path)
    if not path.exists():
        raise DatasetFileMissing(f"prompt file {path} does not exist; expected a {' or '.join(suffixes)} file")
    if not path.is_file():
        raise DatasetError(f"prompt file {path} is not a file; expected a {' or '.join(suffixes)} file")
    if path.suffix not in suffixes:
        raise DatasetError(f"prompt file {path} has suffix {path.suffix!r}; expected {' or '.join(suffixes)}")
    return path


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, stripped text) of each non-empty line; UTF-8 (a BOM is skipped)."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise DatasetError(f"{path}:{line}: byte {data[err.start]:#04x} is not UTF-8; expected a UTF-8 "
                           f"text file") from None
    for number, raw in enumerate(text.split("\n"), start=1):  # not splitlines(): U+2028 may sit in a prompt
        if raw.strip():
            yield number, raw.strip()


def _describe(value: Any) -> str:
    """A JSON value as the file has it, with its JSON type: 'a number 3', 'null', 'an array [1, 2]'."""
    if value is None:
        return "null"
    text = json.dumps(value, ensure_ascii=False)
    return f"{_JSON_TYPES.get(type(value), type(value).__name__)} {text if len(text) <= 80 else text[:77] + '...'}"


def _describe_field(obj: dict[str, Any], name: str) -> str:
    return _describe(obj[name]) if name in obj else f"missing (the line has {sorted(obj) or 'no fields'})"


def _json_object(where: str, text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise DatasetError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); expected one JSON "
                           f"object per line, e.g. {_EXAMPLE}") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: {_describe(obj)}; expected a JSON object per line, e.g. {_EXAMPLE}")
    return obj


def _prompt_fields(where: str, obj: dict[str, Any]) -> dict[str, Any]:
    """PromptRecord's fields from one JSONL object (the prompt, negative prompt, seed and metadata)."""
    prompt, negative, seed = obj.get("prompt"), obj.get("negative_prompt"), obj.get("seed")
    if not isinstance(prompt, str) or not prompt.strip():
        raise DatasetError(f'{where}: "prompt" is {_describe_field(obj, "prompt")}; expected a non-empty string, '
                           f"e.g. {_EXAMPLE}")
    if negative is not None and not isinstance(negative, str):
        raise DatasetError(f'{where}: "negative_prompt" is {_describe(negative)}; expected a string or null')
    if seed is not None and (type(seed) is not int or seed < 0):
        raise DatasetError(f'{where}: "seed" is {_describe(seed)}; expected an integer >= 0 or null')
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, dict):
        raise DatasetError(f'{where}: "metadata" is {_describe(metadata)}; expected a JSON object')
    extras = {k: v for k, v in obj.items() if k not in _FIELDS}
    if extras.keys() & metadata.keys():
        raise DatasetError(f'{where}: fields {sorted(extras.keys() & metadata.keys())} are given both at the '
                           f'top level and in "metadata"; expected each once')
    return dict(prompt=prompt, negative_prompt=negative, seed=seed, metadata={**metadata, **extras})
