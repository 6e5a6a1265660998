"""megatron-core's activation recompute settings (``TransformerConfig.recompute_granularity`` / ``recompute_method``
/ ``recompute_num_layers`` / ``recompute_modules``) on a DiT whose blocks a ``block_runner`` runs
(``model_specs.common.block_runner``): megatron's ``TransformerBlock`` reads them itself, our models run their own
blocks, so ``apply_recompute`` puts them where the blocks run.

* ``full`` + ``uniform``: every ``recompute_num_layers`` consecutive blocks keep only their input for the
  backward and run again inside it (megatron's uniform method: a stage's blocks in equal chunks);
* ``selective`` with ``core_attn`` (megatron's default module): every block's ``core_attention`` keeps only its
  q / k / v and runs again in the backward (the s² attention probabilities of a math-path SDPA are never kept; a
  flash kernel keeps little there anyway).

Why torch's non-reentrant checkpoint, not megatron's ``tensor_parallel.checkpoint``: megatron's is reentrant and
saves only tensor arguments, while our blocks take their conditioning (the timestep embedding, whose weights are
trained) inside a dataclass; a reentrant backward through it frees the outer graph's saved tensors of that
embedding.  megatron's CUDA RNG tracker states are not replayed: the DiT configs have no dropout
(``hidden_dropout = attention_dropout = 0``), so a recomputed block draws nothing.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

SELECTIVE_MODULES = ("core_attn",)


def recompute_config(mode: str, num_layers: int = 1) -> dict:
    """The TransformerConfig fields of a run's ``train.recompute`` (none | full | selective)."""
    if mode == "none":
        return {}
    if mode == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=num_layers)
    if mode == "selective":
        return dict(recompute_granularity="selective", recompute_modules=list(SELECTIVE_MODULES))
    raise ValueError(f"recompute {mode!r}; expected one of none, full, selective")


def apply_recompute(model: torch.nn.Module, config) -> None:
    """``config``'s recompute settings on ``model`` (a family's DiT: ``.blocks`` run by ``.block_runner``), in
    place; nothing when ``config.recompute_granularity`` is None."""
    granularity = config.recompute_granularity
    if granularity is None:
        return
    if granularity == "full":
        if config.recompute_method != "uniform":
            raise ValueError(f"recompute_method={config.recompute_method!r}: the DiT blocks recompute in uniform "
                             f"chunks; expected 'uniform'")
        model.block_runner.recompute_layers = config.recompute_num_layers
        return
    if unknown := sorted(set(config.recompute_modules) - set(SELECTIVE_MODULES)):
        raise ValueError(f"recompute_modules {unknown}: the DiT blocks recompute {list(SELECTIVE_MODULES)} "
                         f"selectively; expected a subset of it")
    attentions = [m for name, m in model.blocks.named_modules() if name.rsplit(".", 1)[-1] == "core_attention"]
    if not attentions:
        raise ValueError(f"{type(model).__name__} has no core_attention modules to recompute selectively")
    for module in attentions:
        module.forward = _checkpointed(module.forward)  # (an instance attribute: the state dict is unchanged)


def _checkpointed(forward):
    def recomputed(*args, **kwargs):
        if not torch.is_grad_enabled():  # a rollout or forward-only pass keeps nothing anyway
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return recomputed
