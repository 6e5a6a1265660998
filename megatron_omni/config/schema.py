"""The run configuration: nested typed dataclasses, one per section of a run.

These classes are OmegaConf structured-config schemas: ``Literal`` fields restrict a string to its
choices, and YAML files and ``a.b=c`` overrides are type-checked against them on merge
(see :mod:`megatron_omni.config.loader`). Checks that span several fields live in ``validate()``.
"""
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from megatron_omni.rollout.config import EngineConfig
from model_specs.common.dtypes import DTYPES
from model_specs.family import family_names, family_of, get_family


class ConfigError(ValueError):
    """A configuration a user wrote cannot work; the message names the dotted key and what was expected."""


def _check_compile(section: str, mode: Optional[str]) -> None:
    from megatron_omni.compile import MODES

    if mode is not None and mode not in MODES:
        raise ConfigError(f"{section}.compile: {mode!r} is not a torch.compile mode; expected one of {MODES} or null")


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

    def data_parallel_size(self, world_size: int) -> int:
        """DP = world / (tp * cp * pp); raises when the world does not split into whole replicas."""
        model_ranks = self.tp * self.cp * self.pp
        if world_size < model_ranks or world_size % model_ranks:
            raise ConfigError(f"parallel: world size {world_size} is not a multiple of tp*cp*pp = {self.tp}*{self.cp}*"
                              f"{self.pp} = {model_ranks}; expected world = tp*cp*pp*dp")
        return world_size // model_ranks

    def check_image_tokens(self, image_tokens: int) -> None:
        """USP splits the image/video tokens evenly over the CP ranks."""
        if image_tokens % self.cp:
            raise ConfigError(f"parallel.cp: {image_tokens} image tokens do not split over cp={self.cp}; expected "
                              f"a resolution whose packed token count is a multiple of {self.cp}")

    def check_microbatches(self, num_microbatches: int) -> None:
        """The interleaved schedule runs micro-batches in groups of pp."""
        if self.vpp is not None and num_microbatches < self.pp:
            raise ConfigError(f"parallel.vpp: the interleaved schedule needs >= pp={self.pp} micro-batches per step, "
                              f"got {num_microbatches}; expected a smaller train.micro_batch_size, more pairs per "
                              f"pass, or parallel.vpp=null")


@dataclass
class ModelConfig:
    family: str = "qwen_image"  # a registered model family (model_specs.family.FAMILIES)
    # the family's arch config (its dataclass, named as the diffusers config.json names it); None = the family's
    # full-size default.  Overrides are type-checked against that dataclass: model.arch.num_layers=4
    arch: Any = None
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"  # the keys of model_specs.common.dtypes.DTYPES
    backend: Literal["auto", "local", "te"] = "auto"  # auto: Transformer Engine when installed, else local
    # a diffusers pipeline folder (model_index.json): the family's text encoder, VAE and scheduler come from it, and
    # the transformer (arch from its config.json, weights unless hf_path / mcore_path say otherwise)
    path: Optional[str] = None
    hf_path: Optional[str] = None  # a diffusers transformer folder (config.json + safetensors)
    mcore_path: Optional[str] = None  # a megatron-core checkpoint written by `megatron-omni convert`
    # the transformer at random init (seeded by train.seed) whatever the folders hold: benchmarks at full size
    # (no 41 GB of weights to write and read); the pipeline's other parts still load from model.path
    random_init: bool = False

    def __post_init__(self):
        if self.arch is None and self.family in family_names():
            self.arch = get_family(self.family).default_arch()

    @property
    def torch_dtype(self):
        return DTYPES[self.dtype]

    @property
    def family_impl(self):
        """The ModelFamily object of ``family``."""
        return get_family(self.family)

    def read_folder(self) -> None:
        """With ``path``: check the pipeline folder is one this family loads and take the transformer's arch from
        it (its weights load from there unless ``hf_path`` / ``mcore_path`` is set)."""
        if self.path is None:
            return
        import json

        index = Path(self.path) / "model_index.json"
        if not index.is_file():
            raise ConfigError(f"model.path: {index} is missing; expected a diffusers pipeline folder of "
                              f"{list(self.family_impl.pipeline_classes)}")
        cls_name = json.loads(index.read_text()).get("_class_name")
        if cls_name not in self.family_impl.pipeline_classes:
            raise ConfigError(f"model.path: {self.path} holds a {cls_name!r}; model.family={self.family!r} loads "
                              f"{list(self.family_impl.pipeline_classes)}")
        config = Path(self.path) / "transformer" / "config.json"
        if not config.is_file():
            raise ConfigError(f"model.path: {self.path} lacks the component 'transformer' ({config} is missing)")
        try:
            self.arch = self.family_impl.arch_from_config(json.loads(config.read_text()))
        except ValueError as e:
            raise ConfigError(f"model.path: {config}: {e}") from None

    @property
    def weights_folder(self) -> Optional[str]:
        """The diffusers transformer folder the initial weights load from (hf_path, else the pipeline's)."""
        if self.random_init:
            return None
        if self.hf_path is not None or self.mcore_path is not None or self.path is None:
            return self.hf_path
        return str(Path(self.path) / "transformer")

    def validate(self, tp: int = 1, ulysses: int = 1, pipeline_chunks: int = 1) -> None:
        if self.family not in family_names():
            raise ConfigError(f"model.family: unknown family {self.family!r}; expected one of {family_names()}")
        self.read_folder()
        if family_of(self.arch) is not self.family_impl:
            raise ConfigError(f"model.arch is a {type(self.arch).__name__} (family {family_of(self.arch).name!r}); "
                              f"model.family={self.family!r} expects a {self.family_impl.arch_class.__name__}: start "
                              f"from a recipe of that family")
        try:
            self.family_impl.check_layout(self.arch, tp, ulysses, pipeline_chunks)
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
    eval_every: int = 0  # steps between evaluations on the held-out prompts (ODE, fixed seeds); 0 = none
    output_dir: str = "runs/demo"
    # torch.compile mode for the policy's blocks (forward + backward), e.g. "default"; None = eager
    compile: Optional[str] = None
    # activation recompute in the training forward (megatron-core's recompute_granularity; model_specs.common.
    # recompute): full = every recompute_num_layers blocks keep only their input and run again in the backward
    # (megatron's uniform method); selective = each block's core attention only; none = everything kept
    recompute: Literal["none", "full", "selective"] = "none"
    recompute_num_layers: int = 1  # blocks per recomputed chunk of full recompute

    def validate(self) -> None:
        _require_positive("train", steps=self.steps, micro_batch_size=self.micro_batch_size,
                          global_batch_size=self.global_batch_size, recompute_num_layers=self.recompute_num_layers)
        if self.recompute != "full" and self.recompute_num_layers != 1:
            raise ConfigError(f"train.recompute_num_layers: {self.recompute_num_layers} with train.recompute="
                              f"{self.recompute}; it counts the blocks per chunk of full recompute: expected 1 or "
                              f"train.recompute=full")
        if not self.lr > 0:
            raise ConfigError(f"train.lr: expected a float > 0, got {self.lr}")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every: expected an integer >= 0 (0 = never), got {self.eval_every}")
        if self.save_every < 0:
            raise ConfigError(f"train.save_every: expected an integer >= 0 (0 = never), got {self.save_every}")
        _check_compile("train", self.compile)
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
class DataConfig:
    # prompts, text encoder and decoder of the run (megatron_omni.data.tasks): "digits" (the demo's pixel-space
    # digits) or "pipeline" (the model.path folder's text encoder and VAE, prompts from data.prompts)
    task: Literal["digits", "pipeline"] = "digits"
    text_max_tokens: int = 16  # digits: prompt tokens kept by the text encoder (padded, masked)
    # "pipeline": a .txt (a prompt per line) or .jsonl ("prompt", optional "negative_prompt") file; None = the
    # packaged OCR prompts (megatron_omni/data/ocr_prompts, Flow-GRPO's visual-text set)
    prompts: Optional[str] = None
    eval_prompts: int = 16  # "pipeline": prompts held out of training for train.eval_every (distinct prompts)
    height: int = 512  # "pipeline": image size in pixels
    width: int = 512
    # "pipeline": the text encoder and VAE in host memory while the policy trains, back on the device at the next
    # encode / decode (megatron_omni.trainer.offload.PartsOffload; nothing moves on a CPU run)
    offload_encoders: bool = False

    def validate(self) -> None:
        _require_positive("data", text_max_tokens=self.text_max_tokens, height=self.height, width=self.width,
                          eval_prompts=self.eval_prompts)
        if self.offload_encoders and self.task != "pipeline":
            raise ConfigError(f"data.offload_encoders: true with data.task={self.task!r}, whose text encoder lives "
                              f"on the host already; expected false or data.task=pipeline")


@dataclass
class RolloutConfig(EngineConfig):
    """The rollout: what to sample, plus the engine's own settings (max_num_seqs, wait_ms, text_pad_multiple,
    fuse: declared once, in ``megatron_omni.rollout.config.EngineConfig``; this section is handed to the engine)."""

    prompts_per_step: int = 8  # groups per RL step
    group_size: int = 8  # samples per prompt (the GRPO group)
    num_steps: int = 10  # denoising steps of a rollout
    shift: float = 1.0  # static timestep shift s: sigma <- s*sigma / (1 + (s - 1)*sigma)
    sampler: Literal["sde", "cps", "dance"] = "sde"  # the trained (stochastic) steps' sampler
    noise_level: float = 0.7  # a of docs/algorithms.md (SDE), eta (Dance), a (CPS)
    # the trained steps' log-prob: the exact Gaussian, or "simple" = -mean (x' - μ)² (CPS references; cps only)
    log_prob_form: Literal["gaussian", "simple"] = "gaussian"
    window_size: Optional[int] = None  # trained SDE steps per trajectory (MixGRPO window); None = all steps
    window_range: Optional[tuple[int, int]] = None  # inclusive range of window starts; None = any that fits
    guidance_scale: float = 1.0  # > 1: true CFG with the empty prompt
    # torch.compile mode for the rollout model's blocks, e.g. "default"; None = eager
    compile: Optional[str] = None
    # where a step's trajectories wait between the rollout and training: device, or host (pinned when the device is
    # a GPU; each training micro-batch is copied to the device as the schedule reaches it: trainer/offload.py)
    trajectories_on: Literal["device", "host"] = "device"
    # how the in-process engine (sync.engine_placement=in_process) is laid out over the trainer's ranks (every rank
    # holds every block, whatever parallel.pp).  whole: TP=1 on every rank, each CP rank the whole sequence.  tp: the
    # trainer's TP shards (1/tp of the blocks' linears per rank; the TP group's ranks generate the same requests
    # together).  tp_cp: tp, and each rollout forward's image tokens split over the CP group as in training (USP).
    # auto: tp when the whole engine would not fit the device (megatron_omni.trainer.memory), else whole
    engine_parallel: Literal["auto", "whole", "tp", "tp_cp"] = "auto"

    def validate(self) -> None:
        try:
            self.check_engine()
        except ValueError as e:
            raise ConfigError(f"rollout.{e}") from None
        _require_positive("rollout", prompts_per_step=self.prompts_per_step, group_size=self.group_size,
                          num_steps=self.num_steps)
        if self.log_prob_form == "simple" and self.sampler != "cps":
            raise ConfigError(f"rollout.log_prob_form: 'simple' is the CPS references' form; with "
                              f"rollout.sampler={self.sampler!r} expected 'gaussian'")
        if self.window_size is not None and not 1 <= self.window_size <= self.num_steps:
            raise ConfigError(f"rollout.window_size: {self.window_size} is outside 1..num_steps={self.num_steps}")
        _check_compile("rollout", self.compile)
        if not self.noise_level > 0:
            raise ConfigError(f"rollout.noise_level: expected > 0 for trained steps, got {self.noise_level}")


@dataclass
class MixGRPOConfig:
    """algorithm.mix_grpo: where the SDE window (rollout.window_size steps, starts in rollout.window_range) lies
    at each RL step (megatron_omni.algorithms.mix_grpo)."""

    # progressive: the start moves by `stride` every `period` RL steps from the range's first start, back to it
    # past the last; random: drawn per RL step (seeded by it)
    window_mode: Literal["progressive", "random"] = "progressive"
    shared: bool = True  # one window for every sample of the step; false: each sample draws its own (random only)
    stride: int = 1
    period: int = 1

    def validate(self) -> None:
        _require_positive("algorithm.mix_grpo", stride=self.stride, period=self.period)
        if not self.shared and self.window_mode != "random":
            raise ConfigError("algorithm.mix_grpo.shared: false draws a window per sample, which only "
                              "window_mode=random does; expected shared=true or window_mode=random")


@dataclass
class FlowDPPOConfig:
    """algorithm.flow_dppo (megatron_omni.algorithms.flow_dppo)."""

    # a trained pair is masked when its Gaussian KL to the old policy's step reaches this and it moves further away
    kl_threshold: float = 1e-5

    def validate(self) -> None:
        if not self.kl_threshold > 0:
            raise ConfigError(f"algorithm.flow_dppo.kl_threshold: expected > 0, got {self.kl_threshold}")


@dataclass
class DanceGRPOConfig:
    """algorithm.dance_grpo (megatron_omni.algorithms.dance_grpo)."""

    shared_noise: bool = True  # the samples of a prompt group start from one initial noise
    # the share of each sample's stochastic steps it trains on, drawn per sample (at least one step)
    timestep_fraction: float = 0.6

    def validate(self) -> None:
        if not 0 < self.timestep_fraction <= 1:
            raise ConfigError(f"algorithm.dance_grpo.timestep_fraction: expected a share in (0, 1], got "
                              f"{self.timestep_fraction}")


@dataclass
class DiffusionDPOConfig:
    """algorithm.diffusion_dpo (megatron_omni.algorithms.diffusion_dpo)."""

    beta: float = 2000.0  # β of the DPO loss: the scale of the flow-matching error differences


@dataclass
class DiffusionNFTConfig:
    """algorithm.diffusion_nft (megatron_omni.algorithms.diffusion_nft)."""

    beta: float = 0.5  # β of the implicit positive / negative velocities, in (0, 1]
    timesteps_per_sample: int = 4  # training rows per sample, at distinct steps of the rollout's schedule
    ref_weight: float = 0.0  # λ of the flow-matching term to the initial policy; 0 = none (no reference forward)
    # the previous policy v_old comes from: "copy" = the rollout's weights (refreshed every RL step); "ema" = an EMA
    # of the weights, θ_old ← ema_decay·θ_old + (1 − ema_decay)·θ after each RL step (from the initial weights)
    old_policy: Literal["copy", "ema"] = "copy"
    ema_decay: float = 0.9


@dataclass
class SRPOConfig:
    """algorithm.srpo (megatron_omni.algorithms.srpo): Direct-Align with a differentiable reward."""

    timesteps_per_sample: int = 2  # training rows per sample, t ~ U[timestep_range] each
    timestep_range: tuple[float, float] = (0.5, 0.9)  # early (noisy) t, t = 1 pure noise
    # the reward's prompts ("{prompt}" is the sample's): r(x̂0 | positive) − r(x̂0 | negative); negative None = none
    positive_prompt: str = "{prompt}"
    negative_prompt: Optional[str] = None
    reward_scale: float = 1.0  # the loss is −scale·mean r


@dataclass
class AlgorithmConfig:
    """The settings shared by the policy-ratio algorithms at the top level; an algorithm's own settings in its
    section, ``algorithm.<name>.<key>`` (validated whichever algorithm runs)."""

    name: str = "flow_grpo"  # a registered algorithm (megatron_omni.algorithms.registry)
    clip_range: float = 1e-4  # epsilon of the clipped ratio (1e-5 for large DiTs)
    adv_std: Literal["global", "group", "none"] = "global"
    adv_clip_max: float = 5.0
    kl_beta: float = 0.0  # weight of the KL to the reference policy; 0 = no reference pass
    kl_form: Literal["flow_grpo", "exact"] = "flow_grpo"
    clip_grad: float = 1.0
    logprob_check_samples: int = 8  # trajectories per step whose log-probs the trainer recomputes
    logprob_warn_abs: float = 1e-2  # warn when mean |rollout - trainer log-prob| exceeds this
    # true CFG: the rollout keeps its uncond output at trained steps, and the first optimizer step of each RL
    # step (and the log-prob check before it) reuse it instead of running the uncond rows: the weights are
    # still the rollout's there, so loss and gradients are unchanged (an exact saving of one forward and the
    # uncond half's backward per pair).  Later optimizer steps of the same RL step recompute it.
    reuse_rollout_uncond: bool = True
    # where pi_old comes from: "rollout" (the log-probs the rollout sampled with), "trainer" (the trainer's own at the
    # rollout's weights: the first optimizer step reads its forward's, so its ratio is exactly 1; a later optimizer
    # step's are scored by one forward-only pass before any update); "auto": trainer with rollout.fp8 or LoRA merged
    # into the rollout's weights (rollout.lora_weights resolved to merged), else rollout.
    # (bf16 rollout and trainer differ by ~1e-5 in log p, a large DiT's whole clip range: bench/RESULTS.md)
    old_log_prob: Literal["auto", "rollout", "trainer"] = "auto"
    mix_grpo: MixGRPOConfig = field(default_factory=MixGRPOConfig)
    flow_dppo: FlowDPPOConfig = field(default_factory=FlowDPPOConfig)
    dance_grpo: DanceGRPOConfig = field(default_factory=DanceGRPOConfig)
    diffusion_dpo: DiffusionDPOConfig = field(default_factory=DiffusionDPOConfig)
    diffusion_nft: DiffusionNFTConfig = field(default_factory=DiffusionNFTConfig)
    srpo: SRPOConfig = field(default_factory=SRPOConfig)

    def validate(self) -> None:
        from megatron_omni.algorithms.registry import algorithm_names

        if self.name not in algorithm_names():
            raise ConfigError(f"algorithm.name: unknown algorithm {self.name!r}; expected one of {algorithm_names()}")
        _require_positive("algorithm", logprob_check_samples=self.logprob_check_samples)
        for section in (self.mix_grpo, self.flow_dppo, self.dance_grpo):
            section.validate()


@dataclass
class RewardConfig:
    """The trained reward and a judge (megatron_omni.rewards).  When every one of them reads latents (``reads =
    "latents"``: latent_scorer, latent_http) the run decodes nothing, and logs no sample grids."""

    name: str = "digit_classifier"  # a registered reward (megatron_omni.rewards.list_rewards())
    # keyword options of the reward's factory, e.g. {url: http://host:8000/score} for latent_http
    options: dict[str, Any] = field(default_factory=dict)
    judge: Optional[str] = "digit_judge"  # logged beside the reward, never trained on; None = no judge
    workers: int = 2

    def validate(self) -> None:
        from megatron_omni.rewards import check_options, list_rewards

        _require_positive("reward", workers=self.workers)
        for key, name, options in (("reward.name", self.name, self.options), ("reward.judge", self.judge, None)):
            if name is None:
                continue
            if name not in list_rewards():
                raise ConfigError(f"{key}: unknown reward {name!r}; expected one of {list_rewards()}")
            try:
                check_options(name, dict(options or {}))
            except ValueError as e:  # a judge is built without options
                raise ConfigError(f"{'reward.options' if options is not None else key}: {e}") from None


@dataclass
class LoRAConfig:
    rank: int = 0  # 0 = full fine-tune; > 0 trains LoRA adapters only
    alpha: float = 0.0  # 0 = same as rank (scale 1)
    targets: Optional[list[str]] = None  # diffusers module names; None = the model family's preset (lora_targets)

    def validate(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"lora.rank: expected >= 0 (0 = full fine-tune), got {self.rank}")


@dataclass
class SyncConfig:
    """Weight sync trainer -> rollout engine (megatron_omni.sync, docs/design.md, decision 5).  A sync that fails
    (an engine process died, the sync group broke) restarts the engine processes once and sends the whole
    model again; a second failure in a row stops the run."""

    # in_process: the engine lives in each trainer rank (no transport); process: engine process(es) behind
    # a dedicated process group (nccl / hccl / gloo); colocated: one engine process on the trainer's device,
    # fed through shared memory (CUDA IPC on GPU)
    engine_placement: Literal["in_process", "process", "colocated"] = "in_process"
    num_engines: int = 1  # engine processes ("process" placement); requests are split evenly over them
    # what each sync sends.  full: the weights as the trainer holds them (no LoRA).  merged: LoRA folded
    # in, W + alpha/r B A, the whole model every step (the engine has no adapters).  lora: the adapters
    # only (~1% of the bytes); the engine wraps its own model in LoRA with the same rank / alpha / targets
    # and is sent the trainer's base weights whole once, at the start and after an engine restart.
    # auto: lora when lora.rank > 0 (the loop builds the engines, so they hold the trainer's base), else full
    mode: Literal["auto", "full", "merged", "lora"] = "auto"
    bucket_mb: int = 1024  # flat byte buckets; 512-2048 MiB suits GPUs, tensors larger than one are chunked
    backend: Literal["auto", "gloo", "nccl", "hccl"] = "auto"  # auto: the trainer device's backend
    checksum: bool = False  # xxh3 per tensor: proves the engine holds exactly the trainer's weights
    timeout_s: float = 300.0  # a dead peer fails the other side after this long instead of hanging

    def validate(self) -> None:
        _require_positive("sync", num_engines=self.num_engines, bucket_mb=self.bucket_mb)
        if not self.timeout_s > 0:
            raise ConfigError(f"sync.timeout_s: expected > 0 seconds, got {self.timeout_s}")
        if self.engine_placement == "colocated" and self.num_engines != 1:
            raise ConfigError(f"sync.num_engines: {self.num_engines} with engine_placement=colocated; expected 1 "
                              f"(one engine process shares the trainer's device)")

    def resolved_mode(self, lora_rank: int) -> str:
        """The export mode of every step's sync ("auto" resolved); raises on a mode that cannot work."""
        if self.mode == "auto":
            return "lora" if lora_rank > 0 else "full"
        if lora_rank == 0 and self.mode in ("lora", "merged"):
            raise ConfigError(f"sync.mode: {self.mode} with lora.rank=0: there are no LoRA adapters to "
                              f"{'send' if self.mode == 'lora' else 'merge'}; expected full or auto, or lora.rank > 0")
        if lora_rank > 0 and self.mode == "full":
            raise ConfigError(f"sync.mode: full with lora.rank={lora_rank} sends the frozen base only, so the engine "
                              f"would never see the trained adapters; expected auto, lora or merged")
        return self.mode


@dataclass
class RunConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)

    @property
    def rollout_merges_lora(self) -> bool:
        """Whether the rollout's weights hold the LoRA adapters (``rollout.lora_weights`` resolved to merged by the
        trainer, adapters synced): its products then differ from the trainer's by rounding, and skip the adapters'."""
        return self.rollout.lora_weights == "merged" and self.sync.resolved_mode(self.lora.rank) == "lora"

    @property
    def lora_targets(self) -> list[str]:
        """``lora.targets``, or the model family's preset."""
        return list(self.lora.targets if self.lora.targets is not None else self.model.family_impl.lora_targets)

    def validate(self) -> None:
        """Raise :class:`ConfigError` on the first field (or combination of fields) that cannot work."""
        self.parallel.validate()
        p = self.parallel
        self.model.validate(p.tp, p.ulysses, p.pp * (p.vpp or 1))
        self.train.validate()
        self.logging.validate()
        for section in (self.data, self.rollout, self.algorithm, self.reward, self.lora, self.sync):
            section.validate()
        self.sync.resolved_mode(self.lora.rank)
        self._validate_split()
        from megatron_omni.algorithms.registry import get_algorithm

        try:
            get_algorithm(self.algorithm.name).check_config(self)  # the algorithm's own settings
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"algorithm.{e}") from None

    def _validate_split(self) -> None:
        p = self.parallel
        if self.sync.engine_placement != "in_process" and self.rollout.engine_parallel in ("tp", "tp_cp"):
            raise ConfigError(f"rollout.engine_parallel: {self.rollout.engine_parallel} lays out the in-process "
                              f"engine over the trainer's groups; with sync.engine_placement="
                              f"{self.sync.engine_placement} each engine process holds the whole model: expected "
                              f"whole or auto, or sync.engine_placement=in_process")
        if self.sync.engine_placement != "in_process" and p.pp > 1:
            raise ConfigError(f"sync.engine_placement: {self.sync.engine_placement} with parallel.pp={p.pp}; the "
                              f"FlowGRPO loop sends from one stage today, expected pp=1 or in_process")
