"""SD3 transformer folders through ``megatron-omni convert``: bit-exact round trips (float32 and bfloat16, sharded
folders), a TP=2-sharded load that runs as diffusers does, and Qwen-Image's clear refusals."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from checkpoints_convert.cli import main as convert_main
from checkpoints_convert.convert import hf_to_mcore
from checkpoints_convert.hf_folder import ConversionError, HFFolder
from checkpoints_convert.mcore_checkpoint import load_model, read_meta
from megatron_omni.parallel.testing import run_distributed
from model_specs.sd3.model import SD3Model
from model_specs.sd3.spec import sd3_block_spec
from tests.sd3.reference import diffusers_reference, make_inputs, reference_forward, rel_err, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CASE = (2, 5, (3, 4))  # batch, text tokens, token grid


def _assert_same_folders(a, b):
    fa, fb = HFFolder(a), HFFolder(b)
    assert sorted(fa.keys()) == sorted(fb.keys())
    for name in fa.keys():
        ta, tb = fa.get(name), fb.get(name)
        assert ta.dtype == tb.dtype and torch.equal(ta, tb), name
    assert fa.config == fb.config


@pytest.mark.parametrize("dtype,shape", [(torch.float32, {}), (torch.bfloat16, {"dual_attention_layers": ()})])
def test_hf_to_mcore_to_hf_is_bit_exact(tmp_path, dtype, shape):
    ref = diffusers_reference(tiny_config(**shape), dtype=dtype)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="500KB")  # several shards + index
    assert (tmp_path / "hf" / "diffusion_pytorch_model.safetensors.index.json").exists()
    assert convert_main(["hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mc"), "--tp", "2",
                         "--quiet"]) == 0
    assert read_meta(tmp_path / "mc")["family"] == "sd3"
    assert convert_main(["mcore-to-hf", "--mcore", str(tmp_path / "mc"), "--out", str(tmp_path / "hf2"),
                         "--quiet"]) == 0
    _assert_same_folders(tmp_path / "hf", tmp_path / "hf2")
    from diffusers import SD3Transformer2DModel

    back = SD3Transformer2DModel.from_pretrained(tmp_path / "hf2", torch_dtype=dtype)
    assert all(torch.equal(p, q) for p, q in zip(back.state_dict().values(), ref.state_dict().values()))


def _tp2_forward(state, root):
    arch = tiny_config()
    model = SD3Model(arch, arch.transformer_config(state.tp), state.tp_group, sd3_block_spec("local"))
    load_model(model, os.path.join(root, "mc"))
    img, txt, pooled, sigma = make_inputs(arch, *CASE)
    with torch.no_grad():
        return model(img, txt, sigma, (1, *CASE[2]), None, pooled)


@pytest.mark.numerics
def test_converted_checkpoint_loads_at_tp2_and_runs_as_diffusers(tmp_path):
    arch = tiny_config()
    ref = diffusers_reference(arch)
    ref.save_pretrained(tmp_path / "hf")
    hf_to_mcore(tmp_path / "hf", tmp_path / "mc", tp=2, progress=False)
    out0, out1 = run_distributed(_tp2_forward, 2, args=(str(tmp_path),), parallel={"tp": 2})
    img, txt, pooled, sigma = make_inputs(arch, *CASE)
    with torch.no_grad():
        expected = reference_forward(ref, arch, img, txt, pooled, sigma, CASE[2])
    print(f"TP=2 load of a converted SD3 checkpoint vs diffusers: {rel_err(out0, expected):.2e}")
    assert torch.equal(out0, out1)
    assert rel_err(out0, expected) <= 1e-5


# ---- bad input: one clear error, nothing written ----------------------------------------------------

@pytest.fixture
def hf_dir(tmp_path):
    diffusers_reference(tiny_config()).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _rewrite(folder, edit):
    hf = HFFolder(folder)
    tensors = {k: hf.get(k) for k in hf.keys()}
    edit(tensors)
    save_file(tensors, str(folder / "diffusion_pytorch_model.safetensors"))


def _break(kind, folder):
    if kind == "other class":
        _edit_config(folder, _class_name="FluxTransformer2DModel")
    elif kind == "unknown key":
        _edit_config(folder, num_single_layers=3)
    elif kind == "unsupported qk_norm":
        _edit_config(folder, qk_norm="layer_norm")
    elif kind == "wrong shape":
        _rewrite(folder, lambda t: t.update({"proj_out.weight": torch.zeros(63, 64)}))
    elif kind == "missing tensor":
        _rewrite(folder, lambda t: t.pop("transformer_blocks.0.attn2.norm_q.weight"))


@pytest.mark.parametrize("kind,message", [
    ("other class", r"config.json is for 'FluxTransformer2DModel', which no model family loads"),
    ("unknown key", r"keys \['num_single_layers'\] unknown to SD3Transformer2DModel"),
    ("unsupported qk_norm", r"qk_norm='layer_norm' is not supported"),
    ("wrong shape", r"tensor 'proj_out.weight' .* has shape \(63, 64\); expected \(64, 64\)"),
    ("missing tensor", r"lacks 1 tensor\(s\) of SD3Transformer2DModel, e.g. \['transformer_blocks.0.attn2.norm_q"),
])
def test_bad_hf_input_is_one_clear_error_and_writes_nothing(hf_dir, tmp_path, kind, message):
    _break(kind, hf_dir)
    with pytest.raises(ConversionError, match=message):
        hf_to_mcore(hf_dir, tmp_path / "out", progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no output, no partial temporary folder either


def test_tp_that_does_not_divide_heads_and_taken_outputs_are_refused(hf_dir, tmp_path, capsys):
    assert convert_main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "out"), "--tp", "3"]) == 1
    err = capsys.readouterr().err
    assert "tensor-parallel size 3 does not divide num_attention_heads=4" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("user data")
    with pytest.raises(ConversionError, match="already exists and is not an empty folder"):
        hf_to_mcore(hf_dir, tmp_path / "taken", progress=False)
    assert (tmp_path / "taken" / "keep.txt").read_text() == "user data"
