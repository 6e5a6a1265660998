"""`megatron-omni`: run in-process through main([...]), and once as `python -m megatron_omni.cli`."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_omni import cli
from megatron_omni.config import load_config

REPO = Path(__file__).resolve().parents[1]


def test_module_entry_point_help_subprocess():
    out = subprocess.run([sys.executable, "-m", "megatron_omni.cli", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for command in ("train", "convert", "generate", "bench", "demo"):
        assert command in out.stdout


@pytest.mark.parametrize("argv, expected", [
    (["train", "--help"], "--print-config"),
    (["generate", "--help"], "--checkpoint"),  # forwarded to megatron_omni.generate
    (["bench", "--help"], "--warmup WARMUP"),  # forwarded to megatron_omni.bench
    (["convert", "--help"], "hf-to-mcore"),  # forwarded to checkpoints_convert.cli
    (["convert", "hf-to-mcore", "--help"], "--tp"),
])
def test_subcommand_help(capsys, argv, expected):
    assert cli.main(argv) == 0
    assert expected in capsys.readouterr().out


def test_train_print_config_is_loadable_yaml(capsys, tmp_path):
    overrides = ["parallel.tp=2", "model.arch.num_layers=4", "model.arch.axes_dims_rope=[8,8,16]"]
    assert cli.main(["train", "--recipe", "qwen_image_tiny", "--print-config", *overrides]) == 0
    path = tmp_path / "printed.yaml"
    path.write_text(capsys.readouterr().out)
    assert load_config(None, str(path), []) == load_config("qwen_image_tiny", None, overrides)


def test_train_refuses_a_model_that_does_not_fit_the_task(capsys):
    assert cli.main(["train", "--recipe", "qwen_image_tiny", "parallel.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "task 'digits' has 4 packed latent channels" in err and "takes and predicts 64" in err


def test_bench_times_the_digits_step(capsys, tmp_path):
    """One bench run (the module's only one): the JSON's medians and the printed table agree on the phases."""
    path = tmp_path / "bench.json"
    argv = ["bench", "--recipe", "digits_flow_grpo", "model.arch.num_layers=2", "--steps", "1", "--warmup", "0",
            "--json", str(path)]
    assert cli.main(argv) == 0
    m = json.loads(path.read_text())["medians"]
    # the DiT side (rollout_sampling + train + sync) leaves out the scoring and the reward wait of the step
    assert 0 < m["dit_seconds"] < m["step_seconds"], m
    assert m["dit_seconds"] == pytest.approx(m["rollout_sampling_seconds"] + m["train_seconds"] + m["sync_seconds"])
    # the rollout's parts are timed inside it
    assert m["rollout_sampling_seconds"] + m["rollout_scoring_seconds"] <= m["rollout_seconds"] + 1e-6, m
    assert m["step_tflop"] > 0 and m["dit_images_per_second"] > m["images_per_second"] > 0, m
    out = capsys.readouterr().out
    rows = {r.strip(): float(s) for r, s in re.findall(r"^│ ([^│]+)│\s*([0-9.]+) │", out, re.M)}
    for phase in ("rollout", "rollout_sampling", "rollout_scoring", "reward", "train", "sync", "DiT side",
                  "end to end"):
        assert phase in rows, (phase, out)
    assert rows["DiT side"] == pytest.approx(m["dit_seconds"], abs=1e-3)
    assert "megatron-omni bench: digits_flow_grpo" in out and "DiT side = rollout_sampling + train + sync" in out


@pytest.mark.parametrize("argv, expected", [
    (["--recipe", "digits_flow_grpo", "--steps", "0"], "--steps 0: expected an integer >= 1"),
    (["--recipe", "digits_flow_grpo", "--warmup", "-1"], "--warmup -1: expected an integer >= 0"),
    (["--steps", "1"], "give --recipe NAME and/or --config FILE.yaml (recipes: "),
    (["--recipe", "nope"], "argument --recipe: invalid choice: 'nope'"),
])
def test_bench_bad_input_is_a_usage_error(capsys, argv, expected):
    assert cli.main(["bench", *argv]) == 2
    captured = capsys.readouterr()
    assert expected in captured.err and captured.out == "", captured


def test_bad_override_clean_message(capsys):
    assert cli.main(["train", "--recipe", "qwen_image_tiny", "parallel.tp=two"]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("megatron-omni train: error: parallel.tp: expected int, got 'two' "
                            "(in override 'parallel.tp=two')\n")
    assert captured.out == ""


def test_train_needs_recipe_or_config(capsys):
    assert cli.main(["train", "parallel.tp=2"]) == 2
    assert "give --recipe NAME and/or --config FILE.yaml" in capsys.readouterr().err


def test_unknown_recipe_is_a_usage_error(capsys):
    assert cli.main(["train", "--recipe", "nope"]) == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_forwarded_module_missing_is_a_clean_error(capsys, monkeypatch):
    monkeypatch.setitem(cli.FORWARDED, "demo", "megatron_omni.no_such_module")
    assert cli.main(["demo"]) == 1
    assert "megatron-omni demo: error: cannot import megatron_omni.no_such_module" in capsys.readouterr().err


def test_train_takes_an_interleaved_pipeline_layout_and_names_the_world_it_needs(capsys, tmp_path):
    """The loop runs interleaved PP (tests/trainer/test_loop_layouts.py); one process is too few ranks for it."""
    argv = ["train", "--recipe", "digits_flow_grpo", "parallel.pp=2", "parallel.vpp=2", "model.arch.num_layers=4",
            f"train.output_dir={tmp_path}"]
    assert cli.main(argv) == 2
    assert "world size 1 is not divisible by tp*cp*pp = 1*1*2 = 2" in capsys.readouterr().err
