"""Named recipes: plain functions returning a :class:`RunConfig`, registered under their function name.

A recipe is the starting point of a run; a YAML file and ``a.b=c`` overrides are merged on top of it
(:func:`megatron_omni.config.load_config`). Add one with ``@register_recipe`` on a function of no arguments.
"""
from typing import Callable

from model_specs.qwen_image.config import QwenImageConfig, tiny_config

from .schema import (AlgorithmConfig, ConfigError, DataConfig, LoggingConfig, LoRAConfig, ModelConfig,
                     ParallelConfig, RewardConfig, RolloutConfig, RunConfig, TrainConfig)

Recipe = Callable[[], RunConfig]
_RECIPES: dict[str, Recipe] = {}


def register_recipe(fn: Recipe) -> Recipe:
    if fn.__name__ in _RECIPES:
        raise ValueError(f"recipe {fn.__name__!r} is already registered; expected a new name")
    _RECIPES[fn.__name__] = fn
    return fn


def recipe_names() -> list[str]:
    return sorted(_RECIPES)


def get_recipe(name: str) -> RunConfig:
    """A fresh RunConfig from the recipe ``name`` (not yet validated)."""
    if name not in _RECIPES:
        raise ConfigError(f"unknown recipe {name!r} (known: {', '.join(recipe_names())})")
    return _RECIPES[name]()


@register_recipe
def qwen_image_tiny() -> RunConfig:
    """Tiny random-init Qwen-Image (2 blocks, 4 heads): CPU tests and the demo (tp*ulysses <= 4, pp <= 2)."""
    return RunConfig(
        parallel=ParallelConfig(),
        model=ModelConfig(arch=tiny_config(), dtype="float32"),  # float32: CPU kernels, exact parity tests
        train=TrainConfig(steps=4, lr=1e-4, micro_batch_size=1, global_batch_size=4, output_dir="runs/demo"),
        logging=LoggingConfig(wandb_mode="offline", project="megatron-omni-demo"),
    )


@register_recipe
def qwen_image_full() -> RunConfig:
    """Full-size Qwen-Image (20B, 60 blocks, 24 heads) on one 8-GPU node: tp=4 x cp=2 (Ulysses).

    Set ``model.hf_path`` to the ``transformer/`` folder of a diffusers Qwen-Image snapshot, or
    ``model.mcore_path`` to a checkpoint converted from it.
    """
    return RunConfig(
        parallel=ParallelConfig(tp=4, cp=2, ulysses=2),
        model=ModelConfig(arch=QwenImageConfig(), dtype="bfloat16"),
        train=TrainConfig(steps=1000, lr=1e-5, micro_batch_size=1, global_batch_size=32, save_every=50,
                          output_dir="runs/qwen_image_full"),
        logging=LoggingConfig(wandb_mode="offline", project="megatron-omni"),
    )


@register_recipe
def digits_flow_grpo() -> RunConfig:
    """The demo: a tiny pixel-space Qwen-Image (4 blocks, hidden 128) on 16x16 digits packed 2x2,
    MiniLM prompts, FlowGRPO against a digit-classifier reward with an SVC judge beside it."""
    arch = tiny_config(in_channels=4, out_channels=1, num_layers=4, joint_attention_dim=384)
    return RunConfig(
        parallel=ParallelConfig(device="cpu"),
        model=ModelConfig(arch=arch, dtype="float32", backend="local"),
        train=TrainConfig(steps=60, lr=1e-4, micro_batch_size=32, global_batch_size=128, save_every=20,
                          output_dir="runs/demo", seed=42),
        logging=LoggingConfig(wandb_mode="offline", project="megatron-omni-demo"),
        data=DataConfig(task="digits", text_max_tokens=16),
        rollout=RolloutConfig(prompts_per_step=8, group_size=8, num_steps=10, noise_level=0.7, window_size=4,
                              max_num_seqs=64),
        algorithm=AlgorithmConfig(clip_range=1e-3, logprob_check_samples=8),
        reward=RewardConfig(name="digit_classifier", judge="digit_judge", workers=2),
    )


@register_recipe
def qwen_image_flow_grpo() -> RunConfig:
    """FlowGRPO on a Qwen-Image pipeline folder (``model.path=DIR``, a QwenImagePipeline saved by diffusers) with
    the OCR reward on the packaged visual-text prompts: VeRL-Omni's Qwen-Image OCR recipe — 512², 10 steps, 32
    prompts x group 16, true CFG 4, SDE noise 1.2, a 2-step window inside the first 6 steps, clip 1e-5, LoRA
    r64 / alpha 128 at lr 3e-4.  The arch and weights come from the folder's transformer/."""
    return RunConfig(
        model=ModelConfig(dtype="bfloat16"),
        train=TrainConfig(steps=300, lr=3e-4, micro_batch_size=4, global_batch_size=512, save_every=50,
                          eval_every=10, output_dir="runs/qwen_image_flow_grpo"),
        logging=LoggingConfig(wandb_mode="offline", project="megatron-omni"),
        data=DataConfig(task="pipeline", prompts=None, eval_prompts=16, height=512, width=512),
        rollout=RolloutConfig(prompts_per_step=32, group_size=16, num_steps=10, noise_level=1.2, window_size=2,
                              window_range=(0, 4), guidance_scale=4.0, max_num_seqs=32),
        algorithm=AlgorithmConfig(clip_range=1e-5, logprob_check_samples=16),
        reward=RewardConfig(name="ocr", judge=None, workers=4),
        lora=LoRAConfig(rank=64, alpha=128),
    )


@register_recipe
def qwen_image_edit_flow_grpo() -> RunConfig:
    """FlowGRPO on a Qwen-Image-Edit pipeline folder (``model.path=DIR``, a QwenImageEditPipeline) over an edit
    dataset (``data.prompts=FILE.jsonl``, a ``{"prompt": instruction, "image": source}`` per line): the OCR
    recipe's settings (512², 10 steps, group 16, true CFG 4, SDE noise 1.2, a 2-step window in the first 6 steps,
    clip 1e-5, LoRA r64 / alpha 128 at lr 3e-4) with each source image resized to the run's size, VAE-encoded as
    context tokens (their own RoPE frame) and seen by the text encoder beside the instruction; the OCR reward
    reads the text the instruction quotes ('Change the sign to read "OPEN"')."""
    cfg = qwen_image_flow_grpo()
    cfg.train.output_dir = "runs/qwen_image_edit_flow_grpo"
    cfg.data.eval_prompts = 8
    return cfg


@register_recipe
def sd35_flow_grpo() -> RunConfig:
    """FlowGRPO on an SD3 / SD3.5 pipeline folder (``model.path=DIR``, a StableDiffusion3Pipeline saved by diffusers)
    with the OCR reward on the packaged visual-text prompts: VeRL-Omni's SD3.5-Medium OCR recipe shape — 512²,
    10 steps, the CPS sampler at noise 0.8 with its simple log-prob, no CFG, a 3-step window inside the first 5
    steps (starts 0..2), group 8, clip 1e-5, LoRA r32 / alpha 64 on the joint attention (the family's preset) at
    lr 3e-4.  The arch and weights come from the folder's transformer/, the shift from its scheduler."""
    return RunConfig(
        model=ModelConfig(family="sd3", dtype="bfloat16"),
        train=TrainConfig(steps=300, lr=3e-4, micro_batch_size=8, global_batch_size=256, save_every=50,
                          eval_every=10, output_dir="runs/sd35_flow_grpo"),
        logging=LoggingConfig(wandb_mode="offline", project="megatron-omni"),
        data=DataConfig(task="pipeline", prompts=None, eval_prompts=16, height=512, width=512),
        rollout=RolloutConfig(prompts_per_step=32, group_size=8, num_steps=10, sampler="cps", noise_level=0.8,
                              log_prob_form="simple", window_size=3, window_range=(0, 2), guidance_scale=1.0,
                              max_num_seqs=32),
        algorithm=AlgorithmConfig(clip_range=1e-5, logprob_check_samples=16),
        reward=RewardConfig(name="ocr", judge=None, workers=4),
        lora=LoRAConfig(rank=32, alpha=64),
    )
