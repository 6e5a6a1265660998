"""The run configuration: nested typed dataclasses, one per section of a run.

These classes are OmegaConf structured-config schemas: ``Literal`` fields restrict a string to its
choices, and YAML files and ``a.b=c`` overrides are type-checked against them on merge
(see :mod:`megatron_omni.config.loader`). Checks that span several fields live in ``validate()``.
"""
from dataclasses import dataclass, field
from typing import Literal, Optional

from model_specs.qwen_image.config import QwenImageConfig


class ConfigError(ValueError):
    """A configuration a user wrote cannot work; the message names the dotted key and what was expected."""


def _require_positive(section: str, **values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ConfigError(f"{section}.{name}: expected an integer >= 1, got {value}")


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel: splits attention heads and MLP width
    cp: int = 1  # context parallel (USP): splits image/video tokens; = ulysses x ring
    ulysses: int = 1  # Ulysses (all-to-all over heads) degree inside cp; ring degree = cp // ulysses
    pp: int = 1  # pipeline parallel: splits the blocks into pp stages
    vpp: Optional[int] = None  # virtual stages per pipeline rank (interleaved 1F1B); None = not interleaved
    device: Literal["auto", "cuda", "npu", "cpu"] = "auto"  # auto: cuda, else npu, else cpu

    @property
    def ring(self) -> int:
        return self.cp // self.ulysses

    def validate(self) -> None:
        _require_positive("parallel", tp=self.tp, cp=self.cp, ulysses=self.ulysses, pp=self.pp)
        if self.cp % self.ulysses:
            raise ConfigError(f"parallel.ulysses: {self.ulysses} does not divide parallel.cp={self.cp}; "
                              f"expected a divisor of cp (ring degree = cp / ulysses)")
        if self.vpp is not None:
            _require_positive("parallel", vpp=self.vpp)
            if self.pp < 2:
                raise ConfigError(f"parallel.vpp: {self.vpp} needs pipeline parallelism; expected "
                                  f"parallel.pp >= 2 (got {self.pp}) or vpp=null")


@dataclass
class ModelConfig:
    # One family today; a new family adds its name here and its arch class to `arch`.
    family: Literal["qwen_image"] = "qwen_image"
    arch: QwenImageConfig = field(default_factory=QwenImageConfig)  # full-size Qwen-Image by default
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    backend: Literal["auto", "local", "te"] = "auto"  # auto: Transformer Engine when installed, else local
    hf_path: Optional[str] = None  # a diffusers transformer folder (config.json + safetensors)
    mcore_path: Optional[str] = None  # a megatron-core checkpoint written by `megatron-omni convert`

    def validate(self, tp: int) -> None:
        try:
            self.arch.validate(tp)
        except ValueError as e:
            raise ConfigError(f"model.arch: {e}") from None
        if self.hf_path is not None and self.mcore_path is not None:
            raise ConfigError(f"model.hf_path={self.hf_path!r} and model.mcore_path={self.mcore_path!r} are "
                              f"both set; expected at most one (the initial weights come from one place)")


@dataclass
class TrainConfig:
    seed: int = 42
    steps: int = 100  # RL steps (rollout + optimizer update each)
    lr: float = 1e-5
    micro_batch_size: int = 1  # samples per forward on one data-parallel rank
    global_batch_size: int = 8  # samples per optimizer step over all data-parallel ranks
    save_every: int = 0  # steps between checkpoints; 0 = no periodic checkpoints
    output_dir: str = "runs/demo"

    def validate(self) -> None:
        _require_positive("train", steps=self.steps, micro_batch_size=self.micro_batch_size,
                          global_batch_size=self.global_batch_size)
        if not self.lr > 0:
            raise ConfigError(f"train.lr: expected a float > 0, got {self.lr}")
        if self.save_every < 0:
            raise ConfigError(f"train.save_every: expected an integer >= 0 (0 = never), got {self.save_every}")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(f"train.global_batch_size: {self.global_batch_size} is not a multiple of "
                              f"train.micro_batch_size={self.micro_batch_size}; expected a multiple")


@dataclass
class LoggingConfig:
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"  # offline: no account or network needed
    project: str = "megatron-omni"  # wandb project name
    log_every: int = 1  # steps between metric lines

    def validate(self) -> None:
        _require_positive("logging", log_every=self.log_every)


@dataclass
class RunConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> None:
        """Raise :class:`ConfigError` on the first field (or combination of fields) that cannot work."""
        self.parallel.validate()
        self.model.validate(self.parallel.tp)
        self.train.validate()
        self.logging.validate()
        self._validate_split()

    def _validate_split(self) -> None:
        p, arch = self.parallel, self.model.arch
        # Ulysses re-splits the heads a TP rank holds, so each of its ranks must get whole heads.
        if arch.num_attention_heads % (p.tp * p.ulysses):
            raise ConfigError(f"parallel.ulysses: tp*ulysses = {p.tp}*{p.ulysses} does not divide "
                              f"model.arch.num_attention_heads={arch.num_attention_heads}; expected a divisor")
        # Even split of the blocks: every (virtual) pipeline stage builds the same number of layers.
        chunks = p.pp * (p.vpp or 1)
        if arch.num_layers % chunks:
            raise ConfigError(f"model.arch.num_layers: {arch.num_layers} does not split over pp*vpp = {chunks} "
                              f"pipeline chunks; expected a multiple of {chunks}")
