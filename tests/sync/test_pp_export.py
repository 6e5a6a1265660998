"""The exporter on a real pipeline-parallel model: at PP=2 each stage exports its own blocks (global
names) and the global tensors once, and together the stages give the diffusers state dict bit for bit."""
import torch

from checkpoints_convert.convert import mcore_state_from_hf
from megatron_omni.parallel.pipeline import stage_layers
from megatron_omni.parallel.testing import run_distributed
from megatron_omni.sync import HFExporter
from model_specs.qwen_image.model import QwenImageModel
from model_specs.qwen_image.spec import qwen_image_block_spec
from tests.qwen_image_reference import diffusers_reference, tiny_config


def _stage_export(state):
    arch = tiny_config(num_layers=4)
    ref = diffusers_reference(arch).state_dict()
    layers = stage_layers(arch.num_layers, state.pp, state.pp_rank)
    model = QwenImageModel(arch, arch.transformer_config(state.tp, perform_initialization=False), state.tp_group,
                           qwen_image_block_spec("local"), pre_process=state.pp_rank == 0,
                           post_process=state.pp_rank == state.pp - 1, layers=layers)
    wanted = mcore_state_from_hf(arch, ref.__getitem__, state.tp_rank, state.tp)
    own = model.state_dict()
    missing = model.load_state_dict({k: v for k, v in wanted.items() if k in own}, strict=False).missing_keys
    assert not [k for k in missing if not k.endswith("_extra_state")]
    exporter = HFExporter(model, state.tp_group, state.pp_group, mode="full", bucket_bytes=64 << 10)
    plan = [m.name for m in exporter.plan()]
    return plan, dict(exporter.tensors()), list(layers)


def test_pp2_stages_export_the_whole_model_once():
    arch = tiny_config(num_layers=4)
    ref = diffusers_reference(arch).state_dict()
    (plan0, out0, layers0), (plan1, out1, layers1) = run_distributed(_stage_export, 2, parallel={"pp": 2})
    assert layers0 == [0, 1] and layers1 == [2, 3]
    assert not set(plan0) & set(plan1) and set(plan0) | set(plan1) == set(ref)
    assert list(out0) == plan0 and list(out1) == plan1
    blocks1 = {n.split(".")[1] for n in plan1 if n.startswith("transformer_blocks.")}
    assert blocks1 == {"2", "3"}  # stage 1 sends its own blocks under global names ...
    assert {n.split(".")[0] for n in plan1 if not n.startswith("transformer_blocks.")} == {"norm_out", "proj_out"}
    # ... and only the global tensors no earlier stage holds (the replicated time embedder goes once)
    for name, tensor in {**out0, **out1}.items():
        assert torch.equal(tensor, ref[name]), name
