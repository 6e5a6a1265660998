"""The run config: recipes, YAML files and dotted overrides, and the messages of the errors they can cause."""
from pathlib import Path

import pytest

from megatron_omni.config import (ConfigError, ModelConfig, RunConfig, config_to_yaml, get_recipe, load_config,
                                  recipe_names)
from model_specs.qwen_image.config import QwenImageConfig, tiny_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", recipe_names())
def test_recipes_build_and_validate(name):
    cfg = load_config(name, None, [])
    assert isinstance(cfg, RunConfig) and isinstance(cfg.model, ModelConfig)
    assert isinstance(cfg.model.arch, cfg.model.family_impl.arch_class)  # the recipe's family's arch
    assert cfg == get_recipe(name)  # loading adds nothing to the recipe


def test_recipe_names_and_tiny_arch():
    assert {"qwen_image_tiny", "qwen_image_full"} <= set(recipe_names())
    assert get_recipe("qwen_image_tiny").model.arch == tiny_config()
    assert get_recipe("qwen_image_full").model.arch == QwenImageConfig()


def test_unknown_recipe_lists_known():
    with pytest.raises(ConfigError, match=r"unknown recipe 'nope' \(known: .*qwen_image_tiny"):
        load_config("nope", None, [])


def test_dotted_overrides_nested_and_tuple():
    cfg = load_config("qwen_image_tiny", None, [
        "parallel.tp=2", "parallel.cp=2", "parallel.ulysses=2", "parallel.device=cpu",
        "model.arch.num_layers=4", "model.arch.axes_dims_rope=[8,8,16]", "train.lr=1e-3",
        "model.hf_path=/ckpt/transformer"])
    assert (cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.ring, cfg.parallel.device) == (2, 2, 1, "cpu")
    assert cfg.model.arch.num_layers == 4
    assert cfg.model.arch.axes_dims_rope == (8, 8, 16)  # a tuple again, not a list or ListConfig
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.lr, float)
    assert cfg.model.hf_path == "/ckpt/transformer"


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("parallel:\n  tp: 2\nmodel:\n  arch:\n    axes_dims_rope: [8, 8, 16]\ntrain:\n  lr: 1e-4\n")
    cfg = load_config("qwen_image_tiny", str(path), ["parallel.tp=4"])
    assert cfg.parallel.tp == 4  # the override wins over the file
    assert cfg.model.arch.axes_dims_rope == (8, 8, 16)
    assert cfg.train.lr == 1e-4


def test_yaml_round_trip(tmp_path):
    cfg = load_config("qwen_image_full", None, ["model.arch.axes_dims_rope=[32,48,48]", "parallel.vpp=null"])
    path = tmp_path / "resolved.yaml"
    path.write_text(config_to_yaml(cfg))
    assert load_config(None, str(path), []) == cfg


def test_example_yaml_in_launch_is_valid():
    cfg = load_config("qwen_image_full", str(REPO / "launch" / "qwen_image_full_2node.yaml"), [])
    assert (cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.ulysses, cfg.parallel.ring) == (4, 4, 2, 2)


@pytest.mark.parametrize("override, message", [
    ("parallel.tpp=2", "unknown key 'parallel.tpp' (known: tp, cp, ulysses, pp, vpp, device)"),
    ("model.arch.num_layerz=2", "unknown key 'model.arch.num_layerz' (known: patch_size,"),
    ("trainer.lr=1", "unknown key 'trainer' (known: parallel, model, train, logging, data, rollout, algorithm, reward, lora, sync)"),
])
def test_unknown_key_names_dotted_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("qwen_image_tiny", None, [override])
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("override, message", [
    ("parallel.tp=two", "parallel.tp: expected int, got 'two'"),
    ("train.lr=fast", "train.lr: expected float, got 'fast'"),
    ("parallel.vpp=x", "parallel.vpp: expected int or null, got 'x'"),
    ("model.arch.num_layers=2.5", "model.arch.num_layers: expected int, got 2.5"),
    ("model.arch.axes_dims_rope=[8,24]", "model.arch.axes_dims_rope: expected tuple[int, int, int], got [8, 24]"),
    ("model.arch.axes_dims_rope.0=4", "model.arch.axes_dims_rope[0]: a tuple is set as a whole; "
                                      "expected model.arch.axes_dims_rope=[...] (tuple[int, int, int])"),
    ("parallel=3", "parallel: expected a section ParallelConfig (keys: tp, cp, ulysses, pp, vpp, device), got 3"),
])
def test_wrong_type_names_key_and_expected_type(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("qwen_image_tiny", None, [override])
    assert str(e.value) == f"{message} (in override {override!r})"  # one line: no OmegaConf trailer


@pytest.mark.parametrize("override, message", [
    ("parallel.device=gpu", "parallel.device: invalid choice 'gpu' (allowed: auto, cuda, npu, cpu)"),
    ("model.dtype=fp8", "model.dtype: invalid choice 'fp8' (allowed: float32, bfloat16, float16)"),
    ("logging.wandb_mode=dryrun",
     "logging.wandb_mode: invalid choice 'dryrun' (allowed: offline, online, disabled)"),
])
def test_invalid_choice(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("qwen_image_tiny", None, [override])
    assert str(e.value) == f"{message} (in override {override!r})"


def test_errors_in_yaml_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("parallel:\n  device: gpu\n")
    with pytest.raises(ConfigError, match=f"parallel.device: invalid choice 'gpu'.*in {path}"):
        load_config("qwen_image_tiny", str(path), [])
    with pytest.raises(ConfigError, match="not found; expected a YAML file"):
        load_config("qwen_image_tiny", str(tmp_path / "missing.yaml"), [])
    path.write_text("parallel: [1\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config("qwen_image_tiny", str(path), [])


def test_override_without_equals():
    with pytest.raises(ConfigError, match=r"override 'parallel.tp': expected the form dotted.key=value"):
        load_config("qwen_image_tiny", None, ["parallel.tp"])


@pytest.mark.parametrize("overrides, message", [
    (["parallel.cp=4", "parallel.ulysses=3"], "parallel.ulysses: 3 does not divide parallel.cp=4"),
    (["parallel.tp=3"], "model.arch: tensor-parallel size 3 does not divide num_attention_heads=4"),
    (["parallel.tp=2", "parallel.cp=4", "parallel.ulysses=4"],
     "model.arch: tp*ulysses = 2*4 does not divide num_attention_heads=4"),
    (["parallel.pp=2", "model.arch.num_layers=3"], "model.arch: num_layers=3 does not split over pp*vpp = 2"),
    (["parallel.vpp=2"], "parallel.vpp: 2 needs pipeline parallelism"),
    (["model.arch.axes_dims_rope=[8,8,8]"], "model.arch: axes_dims_rope=(8, 8, 8) sums to 24"),
    (["train.global_batch_size=6", "train.micro_batch_size=4"], "train.global_batch_size: 6 is not a multiple"),
    (["parallel.tp=0"], "parallel.tp: expected an integer >= 1, got 0"),
    (["model.hf_path=a", "model.mcore_path=b"], "model.hf_path='a' and model.mcore_path='b' are both set"),
])
def test_cross_field_validation(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("qwen_image_tiny", None, overrides)
    assert str(e.value).startswith(message)


def test_a_family_named_in_yaml_or_overrides_types_model_arch(tmp_path):
    """model.arch is the family's dataclass: naming another family (a checkpoint's run_config.yaml, an override)
    starts from that family's default arch, so its own keys merge (issue 22: SD3 runs exported / resumed)."""
    from model_specs.sd3.config import SD3Config

    path = tmp_path / "run.yaml"
    path.write_text("model:\n  family: sd3\n  arch:\n    sample_size: 32\n    num_layers: 2\n    dual_attention_layers: [0]\n")
    cfg = load_config(None, str(path), [])
    assert isinstance(cfg.model.arch, SD3Config) and (cfg.model.arch.sample_size, cfg.model.arch.num_layers) == (32, 2)
    cfg = load_config("qwen_image_tiny", None, ["model.family=sd3", "model.arch.num_layers=14"])
    assert isinstance(cfg.model.arch, SD3Config) and cfg.model.arch.num_layers == 14
