"""Forward and every-gradient parity of our Megatron SD3 with diffusers' SD3Transformer2DModel (float32), for the
3.5-Medium shape (MMDiT-X dual attention, RMS q/k norm) and the 3.5-Large shape at TP=1 (TP=2, CP=2 and PP=2:
test_parallel.py, one launch)."""
import pytest
import torch

from checkpoints_convert.convert import mcore_state_from_hf
from checkpoints_convert.sd3 import sd3_rules
from tests.sd3.reference import (
    SHAPES, diffusers_reference, make_inputs, megatron_from_reference, reference_forward, rel_err, tiny_config,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-5
# (batch, text tokens, token grid (h, w)): non-square both ways, batch > 1, and a square odd grid
CASES = [(2, 5, (3, 5)), (3, 4, (6, 2)), (1, 7, (5, 5))]
GRAD_CASE = (2, 6, (4, 3))


def _grad_errors(model, ref, arch):
    """Relative error of every Megatron gradient against the reference's, mapped through the table."""
    ref_grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in ref.named_parameters()}
    ref_grads["pos_embed.pos_embed"] = ref.pos_embed.pos_embed  # a buffer: no gradient on either side
    expected = mcore_state_from_hf(arch, ref_grads.__getitem__)
    return {n: rel_err(p.grad, expected[n]) for n, p in model.named_parameters()}


def _parity_cases(model, ref, arch):
    forward = []
    for batch, text_len, grid in CASES:
        img, txt, pooled, sigma = make_inputs(arch, batch, text_len, grid)
        with torch.no_grad():
            out = model(img, txt, sigma, (1, *grid), None, pooled)
            forward.append(rel_err(out, reference_forward(ref, arch, img, txt, pooled, sigma, grid)))
    batch, text_len, grid = GRAD_CASE
    img, txt, pooled, sigma = make_inputs(arch, batch, text_len, grid)
    g = torch.randn(batch, grid[0] * grid[1], arch.out_features, generator=torch.Generator().manual_seed(5))
    ref.zero_grad()
    model.zero_grad()
    (reference_forward(ref, arch, img, txt, pooled, sigma, grid) * g).sum().backward()
    (model(img, txt, sigma, (1, *grid), None, pooled) * g).sum().backward()
    return forward, _grad_errors(model, ref, arch)


@pytest.mark.parametrize("shape", SHAPES)
def test_mapping_table_names_every_parameter_once(single_rank, shape):
    arch = tiny_config(**SHAPES[shape])
    ref = diffusers_reference(arch)
    model = megatron_from_reference(ref, arch, single_rank.tp_group)
    rules = sd3_rules(arch)
    assert sorted(r.mcore for r in rules) == sorted(k for k in model.state_dict() if not k.endswith("_extra_state"))
    assert sorted(h for r in rules for h in r.hf) == sorted(ref.state_dict())
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    assert torch.equal(model.pos_embed, ref.pos_embed.pos_embed)  # our own table equals diffusers' bit for bit


@pytest.mark.numerics
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_gradient_parity_tp1(single_rank, shape):
    arch = tiny_config(**SHAPES[shape])
    ref = diffusers_reference(arch)
    model = megatron_from_reference(ref, arch, single_rank.tp_group)
    forward_errs, grad_errs = _parity_cases(model, ref, arch)
    worst = max(grad_errs, key=grad_errs.get)
    print(f"{shape} TP=1 forward rel err per case: {forward_errs}; max grad rel err {grad_errs[worst]:.2e} ({worst}) "
          f"over {len(grad_errs)} parameters")
    assert max(forward_errs) <= TOL
    assert grad_errs[worst] <= TOL, f"{worst}: {grad_errs[worst]}"


@pytest.mark.numerics
def test_sd3_0_shape_without_qk_norm_parity_tp1(single_rank):
    """SD3.0 (``qk_norm=None``, no dual attention): the q / k norms are identities and the table has none."""
    arch = tiny_config(qk_norm=None, dual_attention_layers=())
    ref = diffusers_reference(arch)
    model = megatron_from_reference(ref, arch, single_rank.tp_group)
    assert not any("layernorm" in n for n, _ in model.named_parameters())
    forward_errs, grad_errs = _parity_cases(model, ref, arch)
    print(f"3.0 TP=1 forward rel err per case: {forward_errs}; max grad rel err {max(grad_errs.values()):.2e}")
    assert max(forward_errs) <= TOL and max(grad_errs.values()) <= TOL


@pytest.mark.numerics
def test_padded_text_mask_equals_diffusers_on_the_unpadded_prompt(single_rank):
    """diffusers' SD3 attends to every text token; with a mask, padded keys are left out in every block, so each
    row's image output is diffusers' on that row's real tokens alone (an all-True mask is no mask)."""
    arch = tiny_config()
    ref = diffusers_reference(arch)
    model = megatron_from_reference(ref, arch, single_rank.tp_group)
    img, txt, pooled, sigma = make_inputs(arch, 2, 6, (3, 4))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    with torch.no_grad():
        out = model(img, txt, sigma, (1, 3, 4), mask, pooled)
        assert torch.equal(model(img, txt, sigma, (1, 3, 4), torch.ones_like(mask), pooled),
                           model(img, txt, sigma, (1, 3, 4), None, pooled))
        for b, real in enumerate((6, 4)):
            row = slice(b, b + 1)
            expected = reference_forward(ref, arch, img[row], txt[row, :real], pooled[row], sigma[row], (3, 4))
            assert rel_err(out[row], expected) <= TOL


def test_bad_inputs_name_the_shape(single_rank):
    arch = tiny_config()
    model = megatron_from_reference(diffusers_reference(arch), arch, single_rank.tp_group)
    img, txt, pooled, sigma = make_inputs(arch, 2, 5, (3, 4))
    with pytest.raises(ValueError, match=r"image tokens have shape \(2, 12, 64\); expected \[B, 15, 64\]"):
        model(img, txt, sigma, (1, 3, 5), None, pooled)
    with pytest.raises(ValueError, match=r"pooled text embeddings None; expected pooled_BP of shape \[2, 24\]"):
        model(img, txt, sigma, (1, 3, 4))
    with pytest.raises(ValueError, match="timesteps have shape"):
        model(img, txt, sigma[:1], (1, 3, 4), None, pooled)
    with pytest.raises(ValueError, match=r"image token grid 17 x 1 exceeds pos_embed_max_size=16"):
        big, _, _, _ = make_inputs(arch, 2, 5, (17, 1))
        model(big, txt, sigma, (1, 17, 1), None, pooled)
