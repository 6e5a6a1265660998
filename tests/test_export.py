"""`megatron-omni export`: a real training checkpoint (the digits loop, one RL step, 2 blocks) exported as a LoRA
folder that diffusers' ``load_lora_weights`` loads, and as a merged transformer folder ``from_pretrained`` loads;
each one's forward equals our Megatron policy's at that checkpoint (LoRA on) in float32.

The diffusers model under the LoRA folder gets its base weights from ``HFExporter(mode="full")`` of the policy
rebuilt from the checkpoint: the frozen base as the run held it (the loop writes no base folder of its own), the
same tensors a merged export of zeroed adapters would hold, without a second export.  ``train.lr=1e-2`` moves the
adapters far enough in one step that a missing adapter or a wrong alpha/r scale shows far beyond the tolerance.
A checkpoint written at TP=2 (the trainer's Checkpointer on a TP=2 policy) exports at TP=1 to the same forward.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_omni import cli
from megatron_omni.export import LORA_WEIGHTS, ExportError, find_step, load_policy, read_run_config, single_rank
from megatron_omni.parallel.testing import run_distributed
from model_specs.common.lora import disable_adapters
from tests.qwen_image_reference import make_inputs, reference_forward, rel_err

TOL = 1e-5
FHW = (1, 4, 6)  # token grid of the random inputs; 2 prompts of 7 text tokens, the second with 3 padded
RECIPE, RUN = "digits_flow_grpo", ["train.steps=1", "train.save_every=1", "train.lr=1e-2",
         "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.num_steps=4", "rollout.window_size=2",
         "train.micro_batch_size=4", "train.global_batch_size=4", "algorithm.logprob_check_samples=2",
         "logging.wandb_mode=disabled", "model.arch.num_layers=2"]


def _train(run_dir: Path, *overrides: str) -> Path:
    assert cli.main(["train", "--recipe", RECIPE, *RUN, *overrides, f"train.output_dir={run_dir}"]) == 0
    step_dir = run_dir / "checkpoints" / "step_000000"
    assert (step_dir / "run_config.yaml").is_file(), "the loop wrote no run_config.yaml beside its checkpoint"
    return run_dir


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("export") / "lora_run", "lora.rank=4", "lora.alpha=8")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("export") / "full_run", "lora.rank=0")


def _outputs(module: torch.nn.Module, cfg, tp_group) -> dict:
    """A policy's forward on fixed random inputs (adapters on, and off for a LoRA run), its base weights under
    diffusers' names and the diffusers config of its arch (a collective over ``tp_group``)."""
    from megatron_omni.sync import HFExporter

    inputs = make_inputs(cfg.model.arch, 2, 7, FHW, [0, 3])
    with torch.no_grad():
        out = {"inputs": inputs, "on": module(*inputs[:3], FHW, inputs[3])}
        with disable_adapters(module):
            out["off"] = module(*inputs[:3], FHW, inputs[3])
        out["base"] = {n: t.clone() for n, t in HFExporter(module, tp_group, mode="full").tensors()}
    family = cfg.model.family_impl
    out["config"] = {k: v for k, v in family.arch_to_config(cfg.model.arch).items() if not k.startswith("_")}
    return out


def _policy_outputs(run_dir: Path) -> dict:
    """``_outputs`` of our policy at the run's latest checkpoint, rebuilt at TP=1 in this process."""
    step_dir, _ = find_step(run_dir)
    cfg = read_run_config(step_dir)
    with single_rank(cfg.train.seed) as state:
        return _outputs(load_policy(step_dir, cfg, state), cfg, state.tp_group)


@pytest.fixture(scope="module")
def lora_policy(lora_run) -> dict:
    return _policy_outputs(lora_run)


def _diffusers_forward(model, inputs) -> torch.Tensor:
    img, txt, sigma, mask = inputs
    with torch.no_grad():
        return reference_forward(model.eval(), img, txt, sigma, FHW, mask)


def _export(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli.main(["export", "--quiet", *args])
    return rc, capsys.readouterr().err


def _check_lora_folder(out: Path, policy: dict) -> float:
    """Load ``out`` with ``pipe.load_lora_weights`` onto the policy's base; the rel err of its forward."""
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
    from safetensors import safe_open

    with safe_open(out / LORA_WEIGHTS, framework="pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("transformer.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
                        for k in keys), keys[:4]
    transformer = QwenImageTransformer2DModel(**policy["config"])
    transformer.load_state_dict(policy["base"], strict=True)
    pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=transformer)
    pipe.load_lora_weights(str(out))
    config = next(iter(transformer.peft_config.values()))
    assert (config.r, config.lora_alpha) == (4, 8)  # alpha != rank: read from the file's metadata
    err, lora_effect = rel_err(_diffusers_forward(transformer, policy["inputs"]), policy["on"]), \
        rel_err(policy["off"], policy["on"])
    print(f"LoRA folder via load_lora_weights: rel err {err:.2e}; adapters change the output by {lora_effect:.2e}")
    assert lora_effect > 100 * TOL  # so a missing adapter or a wrong alpha/r scale would fail the check of err
    return err


def _check_merged_folder(out: Path, policy: dict) -> float:
    from diffusers import QwenImageTransformer2DModel

    err = rel_err(_diffusers_forward(QwenImageTransformer2DModel.from_pretrained(str(out)), policy["inputs"]),
                  policy["on"])
    print(f"{out.name} folder via from_pretrained: rel err {err:.2e}")
    return err


@pytest.mark.numerics
def test_lora_folder_loads_with_load_lora_weights(lora_run, lora_policy, tmp_path, capsys):
    out = tmp_path / "lora"
    assert _export(capsys, "--checkpoint", str(lora_run), "--out", str(out))[0] == 0
    assert _check_lora_folder(out, lora_policy) <= TOL


@pytest.mark.numerics
def test_merged_folder_equals_the_lora_forward(lora_run, lora_policy, tmp_path, capsys):
    out = tmp_path / "merged"
    assert _export(capsys, "--checkpoint", str(lora_run / "checkpoints"), "--out", str(out), "--merged")[0] == 0
    assert _check_merged_folder(out, lora_policy) <= TOL


@pytest.mark.numerics
def test_full_finetune_exports_merged_only(full_run, tmp_path, capsys):
    rc, err = _export(capsys, "--checkpoint", str(full_run), "--out", str(tmp_path / "lora"))
    assert rc == 1 and "use --merged" in err and not (tmp_path / "lora").exists()
    out = tmp_path / "full"
    assert _export(capsys, "--checkpoint", str(full_run), "--out", str(out), "--merged")[0] == 0
    assert _check_merged_folder(out, _policy_outputs(full_run)) <= TOL


def _save_tp2(state, run_dir: Path) -> dict | None:
    """Rank body: a LoRA policy at TP=2 with random adapters, saved as the loop saves it (its DDP wrapper and
    optimizer through the trainer's Checkpointer; the loop's in-process engine does not run at TP=2 today), and
    that policy's own TP=2 forward as the reference: independent of the export's loader."""
    from megatron_omni.config import config_to_yaml, load_config
    from megatron_omni.trainer.checkpoint import Checkpointer
    from megatron_omni.trainer.policy import build_policy
    from model_specs.common.lora import apply_lora, load_peft_state_dict, peft_state_dict

    cfg = load_config(RECIPE, None, [*RUN, "lora.rank=4", "lora.alpha=8", "parallel.tp=2"])
    rules = cfg.model.family_impl.rules(cfg.model.arch)
    torch.manual_seed(cfg.train.seed)
    policy = build_policy(cfg.model.arch, state, lr=cfg.train.lr, prepare=lambda m: apply_lora(
        m, cfg.lora.rank, cfg.lora.alpha, cfg.lora_targets, rules, seed=cfg.train.seed))
    g = torch.Generator().manual_seed(0)  # the same whole tensors on both ranks; each keeps its slice
    load_peft_state_dict(policy.module, {n: torch.randn(t.shape, generator=g) * 0.1 if ".lora_B." in n else t
                                         for n, t in peft_state_dict(policy.module).items()})
    Checkpointer(run_dir / "checkpoints", run_config=config_to_yaml(cfg)).save(0, policy.model, policy.optimizer, {})
    out = _outputs(policy.module, cfg, state.tp_group)  # a collective: the TP=2 forward and gather
    return out if state.rank == 0 else None


@pytest.mark.numerics
def test_tp2_checkpoint_exports_at_tp1(tmp_path, capsys):
    """A checkpoint written at TP=2 is resharded on load: both forms match the TP=2 policy's forward."""
    run_dir = tmp_path / "tp2_run"
    policy = run_distributed(_save_tp2, 2, args=(run_dir,), parallel={"tp": 2, "seed": 42}, timeout_s=600)[0]
    for form, extra in (("lora", []), ("merged", ["--merged"])):
        assert _export(capsys, "--checkpoint", str(run_dir), "--out", str(tmp_path / form), *extra)[0] == 0
    assert _check_lora_folder(tmp_path / "lora", policy) <= TOL
    assert _check_merged_folder(tmp_path / "merged", policy) <= TOL


def test_bad_inputs_one_line_nothing_written(lora_run, tmp_path, capsys):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    empty = tmp_path / "not_a_checkpoint"
    empty.mkdir()
    cases = [  # (arguments, what the message names)
        (["--checkpoint", str(empty), "--out", str(tmp_path / "o1")], "is not a training checkpoint"),
        (["--checkpoint", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o2")], "is not a directory"),
        (["--checkpoint", str(lora_run), "--step", "7", "--out", str(tmp_path / "o3")], "--step 7: no checkpoint"),
        (["--checkpoint", str(lora_run), "--out", str(busy)], "already exists and is not an empty folder"),
    ]
    for args, expected in cases:
        rc, err = _export(capsys, *args)
        assert rc == 1, args
        assert len(err.strip().splitlines()) == 1 and err.startswith("megatron-omni export: error: "), err
        assert expected in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "not_a_checkpoint"]  # no output, no .partial
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]


def test_checkpoint_is_a_run_its_checkpoints_or_a_step_dir(lora_run):
    step_dir = lora_run / "checkpoints" / "step_000000"
    for given in (lora_run, lora_run / "checkpoints", step_dir):
        assert find_step(given) == (step_dir, 0)
    assert find_step(lora_run, step=0) == (step_dir, 0)
    with pytest.raises(ExportError, match="--step 3: .* is the folder of step 0"):
        find_step(step_dir, step=3)


def test_help_documents_every_flag(capsys):
    assert cli.main(["export", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--checkpoint", "--out", "--merged", "--step", "--quiet", "e.g."):
        assert flag in text
    assert cli.main(["--help"]) == 0
    assert "export" in capsys.readouterr().out
