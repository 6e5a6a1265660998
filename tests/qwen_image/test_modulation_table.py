"""A forward that reads its adaLN modulations from a ModulationTable (what the rollout engine does: the table
is built once per batch for all of its sigmas) computes what a forward that computes them does; misuse is
refused with an error naming it."""
import pytest
import torch

from checkpoints_convert.qwen_image import qwen_image_rules
from model_specs.common.lora import FLOW_GRPO_TARGETS, apply_lora, lora_modules
from model_specs.qwen_image.config import tiny_config
from model_specs.qwen_image.model import QwenImageModel
from model_specs.qwen_image.spec import qwen_image_block_spec

ARCH = tiny_config(num_layers=2)
FHW = (1, 4, 4)
SIGMAS = torch.tensor([1.0, 0.75, 0.4, 0.1])


@pytest.fixture(scope="module")
def model(single_rank):
    torch.manual_seed(0)
    m = QwenImageModel(ARCH, ARCH.transformer_config(1, params_dtype=torch.float32), single_rank.tp_group,
                       qwen_image_block_spec("local"))
    # adapters on the modulation linears too: the table must hold their output, not the base's alone
    apply_lora(m, 4, 8.0, [*FLOW_GRPO_TARGETS, "img_mod.1", "txt_mod.1"], qwen_image_rules(ARCH), seed=0)
    for a in lora_modules(m).values():
        torch.nn.init.normal_(a.lora_B, std=0.05)
    return m.eval()


def _inputs(batch=3):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 16, ARCH.in_channels, generator=g), torch.randn(batch, 8, ARCH.joint_attention_dim,
                                                                              generator=g)


@pytest.mark.numerics
def test_table_rows_equal_the_computed_modulation(model):
    img, txt = _inputs()
    with torch.no_grad():
        table = model.modulation_table(SIGMAS)
        assert set(table.blocks) == set(range(ARCH.num_layers)) and table.temb_NH.shape[0] == len(SIGMAS)
        for n, sigma in enumerate(SIGMAS):
            sigma_B = sigma.expand(img.shape[0])
            expected = model(img, txt, sigma_B, FHW)
            got = model(img, txt, sigma_B, FHW, modulation=table.step(n))
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        # another step's row is another timestep: the output must change (the test can fail)
        wrong = model(img, txt, SIGMAS[0].expand(img.shape[0]), FHW, modulation=table.step(2))
        assert not torch.allclose(wrong, model(img, txt, SIGMAS[0].expand(img.shape[0]), FHW), rtol=1e-3, atol=1e-3)


def test_misuse_is_refused(model):
    img, txt = _inputs()
    sigma_B = SIGMAS[1].expand(img.shape[0])
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        model.modulation_table(SIGMAS)  # grad enabled: training computes the modulation itself
    with torch.no_grad():
        table = model.modulation_table(SIGMAS)
        with pytest.raises(ValueError, match="expected one timestep"):
            model(img, txt, sigma_B, FHW, modulation=table)
        with pytest.raises(IndexError, match="timestep 4 is outside"):
            table.step(len(SIGMAS))
    with pytest.raises(ValueError, match="grad enabled"):
        model(img, txt, sigma_B, FHW, modulation=table.step(1))
