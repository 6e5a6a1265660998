"""HF <-> Megatron conversion: bit-exact round trips, resharding on load, and clear errors on bad input."""
import json
import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from checkpoints_convert.cli import main as convert_main
from checkpoints_convert.convert import hf_to_mcore, mcore_to_hf
from checkpoints_convert.hf_folder import ConversionError, HFFolder
from checkpoints_convert.mcore_checkpoint import load_model, read_meta, save_model
from checkpoints_convert.mapping import tp_shard
from model_specs.qwen_image.model import QwenImageModel
from model_specs.qwen_image.spec import qwen_image_block_spec
from megatron_omni.parallel.testing import run_distributed
from tests.qwen_image_reference import diffusers_reference, make_inputs, reference_forward, rel_err, tiny_config

CASE = (2, 6, (1, 4, 6), [0, 2])  # batch, text tokens, token grid, padding per sample


def _assert_same_folders(a, b):
    fa, fb = HFFolder(a), HFFolder(b)
    assert sorted(fa.keys()) == sorted(fb.keys())
    for name in fa.keys():
        ta, tb = fa.get(name), fb.get(name)
        assert ta.dtype == tb.dtype and torch.equal(ta, tb), name
    assert fa.config == fb.config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_to_mcore_to_hf_is_bit_exact(tmp_path, dtype):
    ref = diffusers_reference(tiny_config(), dtype=dtype)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="1MB")  # several shards + index
    assert (tmp_path / "hf" / "diffusion_pytorch_model.safetensors.index.json").exists()
    assert convert_main(["hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mc"), "--tp", "2",
                         "--quiet"]) == 0
    assert read_meta(tmp_path / "mc")["tp"] == 2
    assert convert_main(["mcore-to-hf", "--mcore", str(tmp_path / "mc"), "--out", str(tmp_path / "hf2"),
                         "--quiet"]) == 0
    _assert_same_folders(tmp_path / "hf", tmp_path / "hf2")
    # the written folder is a real diffusers folder
    from diffusers import QwenImageTransformer2DModel

    back = QwenImageTransformer2DModel.from_pretrained(tmp_path / "hf2", torch_dtype=dtype)
    assert all(torch.equal(p, q) for p, q in zip(back.state_dict().values(), ref.state_dict().values()))


def test_mcore_to_hf_shards_large_outputs(tmp_path):
    ref = diffusers_reference(tiny_config())
    ref.save_pretrained(tmp_path / "hf")
    hf_to_mcore(tmp_path / "hf", tmp_path / "mc", progress=False)
    mcore_to_hf(tmp_path / "mc", tmp_path / "hf2", progress=False, max_shard_bytes=2**20)
    index = json.loads((tmp_path / "hf2" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _assert_same_folders(tmp_path / "hf", tmp_path / "hf2")


def _tp2_worker(state, root):
    """At TP=2: load the converted checkpoint, run a forward, save again (a TP=2-written checkpoint);
    also check that random init does not depend on the TP size."""
    arch = tiny_config()
    config = arch.transformer_config(state.tp)
    model = QwenImageModel(arch, config, state.tp_group, qwen_image_block_spec("local"))
    load_model(model, os.path.join(root, "mc"))
    img, txt, sigma, mask = make_inputs(arch, *CASE)
    with torch.no_grad():
        out = model(img, txt, sigma, CASE[2], mask)
    save_model(model, os.path.join(root, "mc_tp2"), read_meta(os.path.join(root, "mc")))

    # random init at TP=2 equals the TP=1 init's slice (use_cpu_initialization draws full weights)
    singles = [dist.new_group([r]) for r in range(state.world_size)]
    inits = []
    for tp_group in (state.tp_group, singles[state.rank]):
        torch.manual_seed(123)
        inits.append(QwenImageModel(arch, arch.transformer_config(tp_group.size()), tp_group,
                                    qwen_image_block_spec("local")))
    full = dict(inits[1].named_parameters())
    init_same = all(
        torch.equal(p, tp_shard(full[n], getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False)
                                else None, state.tp_rank, state.tp))
        for n, p in inits[0].named_parameters())
    return out, init_same


@pytest.mark.numerics
def test_tp2_checkpoint_loads_at_tp1_with_the_same_forward(tmp_path, single_rank):
    arch = tiny_config()
    ref = diffusers_reference(arch)
    ref.save_pretrained(tmp_path / "hf")
    hf_to_mcore(tmp_path / "hf", tmp_path / "mc", tp=2, progress=False)
    outs = run_distributed(_tp2_worker, 2, args=(str(tmp_path),), parallel={"tp": 2})
    (out_tp2, init_same0), (out_tp2_b, init_same1) = outs
    assert init_same0 and init_same1
    assert torch.equal(out_tp2, out_tp2_b)

    model = QwenImageModel(arch, arch.transformer_config(1), single_rank.tp_group, qwen_image_block_spec("local"))
    load_model(model, tmp_path / "mc_tp2")
    img, txt, sigma, mask = make_inputs(arch, *CASE)
    with torch.no_grad():
        out_tp1 = model(img, txt, sigma, CASE[2], mask)
        expected = reference_forward(ref, img, txt, sigma, CASE[2], mask)
    print(f"TP=2-written checkpoint at TP=1 vs TP=2: {rel_err(out_tp1, out_tp2):.2e}; vs diffusers "
          f"{rel_err(out_tp1, expected):.2e}")
    assert rel_err(out_tp1, out_tp2) <= 1e-6
    assert rel_err(out_tp1, expected) <= 1e-5
    mcore_to_hf(tmp_path / "mc_tp2", tmp_path / "hf2", progress=False)
    _assert_same_folders(tmp_path / "hf", tmp_path / "hf2")


# ---- bad input: one clear error, nothing written ----------------------------------------------------

@pytest.fixture
def hf_dir(tmp_path):
    diffusers_reference(tiny_config()).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _break(kind, folder):
    if kind == "no config":
        (folder / "config.json").unlink()
    elif kind == "no weights":
        (folder / "diffusion_pytorch_model.safetensors").unlink()
    elif kind == "other class":
        _edit_config(folder, _class_name="FluxTransformer2DModel")
    elif kind == "unknown key":
        _edit_config(folder, num_single_layers=3)
    elif kind == "wrong shape":
        hf = HFFolder(folder)
        tensors = {k: hf.get(k) for k in hf.keys()}
        tensors["proj_out.weight"] = torch.zeros(63, 128)
        save_file(tensors, str(folder / "diffusion_pytorch_model.safetensors"))
    elif kind == "missing tensor":
        hf = HFFolder(folder)
        tensors = {k: hf.get(k) for k in hf.keys() if k != "txt_norm.weight"}
        save_file(tensors, str(folder / "diffusion_pytorch_model.safetensors"))


@pytest.mark.parametrize("kind,message", [
    ("no config", r"config.json is missing"),
    ("no weights", r"holds neither diffusion_pytorch_model.safetensors nor"),
    ("other class", r"config.json is for 'FluxTransformer2DModel', which no model family loads; expected one of \['QwenImageTransformer2DModel', 'SD3Transformer2DModel'\]"),
    ("unknown key", r"keys \['num_single_layers'\] unknown"),
    ("wrong shape", r"tensor 'proj_out.weight' .* has shape \(63, 128\); expected \(64, 128\)"),
    ("missing tensor", r"lacks 1 tensor\(s\) of QwenImageTransformer2DModel, e.g. \['txt_norm.weight'\]"),
])
def test_bad_hf_input_is_one_clear_error_and_writes_nothing(hf_dir, tmp_path, kind, message):
    _break(kind, hf_dir)
    with pytest.raises(ConversionError, match=message):
        hf_to_mcore(hf_dir, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no partial temporary folder either


def test_tp_that_does_not_divide_heads_is_refused(hf_dir, tmp_path, capsys):
    assert convert_main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "out"), "--tp", "3"]) == 1
    err = capsys.readouterr().err
    assert "tensor-parallel size 3 does not divide num_attention_heads=4" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_existing_output_and_non_checkpoints_are_refused(hf_dir, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("user data")
    with pytest.raises(ConversionError, match="already exists and is not an empty folder"):
        hf_to_mcore(hf_dir, tmp_path / "taken", progress=False)
    assert (tmp_path / "taken" / "keep.txt").read_text() == "user data"
    with pytest.raises(ConversionError, match="is not a Megatron distributed checkpoint"):
        mcore_to_hf(hf_dir, tmp_path / "out", progress=False)
    with pytest.raises(ConversionError, match="pipeline-parallel size 5 must be between 1 and num_layers=2"):
        hf_to_mcore(hf_dir, tmp_path / "out", pp=5, progress=False)
