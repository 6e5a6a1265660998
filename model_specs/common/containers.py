"""Containers that keep megatron-core's distributed-checkpoint sharding intact."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule


class MegatronModuleList(MegatronModule):
    """A ModuleList that is a MegatronModule.

    megatron-core's ``sharded_state_dict`` treats a plain ``torch.nn.ModuleList`` as one replicated
    module and never reaches the tensor-parallel layers inside it, so a TP checkpoint would store
    each rank's slice as if it were the whole tensor.  As a MegatronModule this list recurses into
    every child; children are named "0", "1", ... exactly like ModuleList, so parameter names match.
    """

    def __init__(self, config: TransformerConfig, modules: Iterable[torch.nn.Module]):
        super().__init__(config=config)
        for i, module in enumerate(modules):
            self.add_module(str(i), module)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self._modules.values())

    def __getitem__(self, i: int) -> torch.nn.Module:
        return self._modules[str(i % len(self))]
