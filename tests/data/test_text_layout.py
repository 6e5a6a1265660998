"""megatron_omni.data.text_layout: many prompts' real tokens with one host read of their masks, equal to the
per-prompt boolean indexing for right-padded, left-padded and unmasked prompts; its errors name the prompt."""
import pytest
import torch

from megatron_omni.data.text_layout import real_tokens, real_tokens_of


def _entries():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(4, 6, 8, generator=g)
    right = torch.tensor([True, True, True, False, False, False])  # a prefix: the encoders' right padding
    left = torch.tensor([False, False, True, True, True, True])
    holes = torch.tensor([True, False, True, False, True, False])
    return {"right": (emb[0], right), "left": (emb[1], left), "holes": (emb[2], holes), "whole": (emb[3], None)}


def test_real_tokens_of_equals_per_prompt_indexing():
    entries = _entries()
    got = real_tokens_of(entries)
    assert list(got) == list(entries)
    for prompt, (emb, mask) in entries.items():
        assert torch.equal(got[prompt], real_tokens(emb, mask, prompt)), prompt
    assert got["right"].shape == (3, 8) and got["holes"].shape == (3, 8) and got["whole"].shape == (6, 8)
    assert got["right"].data_ptr() != entries["right"][0].data_ptr()  # a copy, as real_tokens gives


def test_real_tokens_of_errors_name_the_prompt():
    emb = torch.randn(5, 8)
    with pytest.raises(ValueError, match="'empty' has no real token"):
        real_tokens_of({"ok": (emb, torch.ones(5, dtype=torch.bool)), "empty": (emb, torch.zeros(5, dtype=torch.bool))})
    with pytest.raises(ValueError, match=r"prompt 'short': mask has shape \(4,\); expected \[5\]"):
        real_tokens_of({"short": (emb, torch.ones(4, dtype=torch.bool))})
