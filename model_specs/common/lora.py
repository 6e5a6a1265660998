"""LoRA adapters on megatron-core's tensor-parallel linears, named and laid out like diffusers + peft.

``apply_lora(model, rank, alpha, targets, rules)`` wraps every linear whose diffusers name matches a
target (peft's rule: the name equals the target or ends with ``"." + target``) in a ``LoRALinear``:
y = base(x) + (alpha / rank) * B (A x), base frozen, B initialised to zero.  ``rules`` is the family's
HF <-> Megatron mapping table (e.g. ``checkpoints_convert.qwen_image.qwen_image_rules(arch)``): it says
which Megatron module a diffusers module is, and which ones are fused QKV.

Fused QKV.  Our ``linear_qkv`` is to_q, to_k, to_v in one matrix, rows interleaved per head
(``checkpoints_convert.mapping.fuse_qkv``).  Targeting to_q / to_k / to_v gives that linear one adapter
*part* per selected projection: A_j [r, in], B_j [H*D, r] exactly as peft's separate LoRAs, and the
parts' outputs are interleaved per head like the fused weight.  So the fused layer computes exactly
what three peft LoRAs on the unfused diffusers linears compute, and the peft tensors load unchanged.

Tensor parallelism (no sequence parallelism):
* column-parallel base: A replicated, B split along its rows like the base's output.  h = A x is
  computed on every rank; its gradient is all-reduced over TP (``copy_to_tensor_model_parallel_region``),
  which makes A's gradient whole and identical on every rank and adds the LoRA path's input gradient.
  ``gather_output=True`` bases (adaLN modulation) all-gather the LoRA output too.
* row-parallel base: A split along its input columns like the base's weight, B replicated.  The partial
  h = A_local x_local is all-reduced on its own (``reduce_from_tensor_model_parallel_region``), a
  [tokens, r] all-reduce.  Folding the low-rank path into the base's [tokens, out] all-reduce instead
  would leave B's gradient a partial sum on each rank (it would need its own TP all-reduce); the extra
  rank-r all-reduce is the cheaper and simpler correct choice.
* plain ``torch.nn.Linear`` (replicated on every TP rank): A and B replicated, no communication.
A is drawn from a generator seeded by (seed, diffusers name) over the *global* input, then sliced, so
the adapters are the same at every TP size.

Parameters: ``lora_A`` [P, r, in_local], ``lora_B`` [P, out_local / n_fused, r] for P adapter parts.
Module names gain ``.base`` (``linear_qkv.base.weight``); distributed-checkpoint keys keep the original
names (``LoRALinear.sharded_state_dict``), and ``merged_state`` / ``peft_state_dict`` give export names.
Legend: P adapter parts, R rank, I input features, O output rows (per part), N local heads, D head dim.
"""
from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region, scatter_to_tensor_model_parallel_region,
)

from checkpoints_convert.mapping import QKV, Rule, fuse_qkv, tp_shard
from model_specs.common.rollout_linear import RolloutLinear

COLUMN, ROW, REPLICATED = "column", "row", "replicated"
# the flow_grpo / VeRL-Omni default for Qwen-Image: every attention and MLP linear of the blocks
FLOW_GRPO_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                     "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")


@dataclass(frozen=True)
class LoRATarget:
    """One wrapped Megatron linear: its module name, the diffusers names of its adapter parts and
    which of the base's ``n_fused`` stacked projections (q, k, v for a fused QKV) they are."""

    mcore: str
    hf: tuple[str, ...]
    parts: tuple[int, ...]
    n_fused: int


def _matches(hf_module: str, target: str) -> bool:
    return hf_module == target or hf_module.endswith("." + target)


def resolve_targets(rules: Sequence[Rule], targets: Sequence[str]) -> list[LoRATarget]:
    """The linears ``targets`` (diffusers module names or suffixes) select, through the mapping table."""
    found, used = [], set()
    for rule in rules:
        if not rule.mcore.endswith(".weight"):
            continue
        hf_modules = [h.removesuffix(".weight") for h in rule.hf]
        parts = tuple(j for j, h in enumerate(hf_modules) if any(_matches(h, t) for t in targets))
        used.update(t for t in targets for h in hf_modules if _matches(h, t))
        if parts:
            n_fused = 3 if rule.transform == QKV else 1
            found.append(LoRATarget(rule.mcore.removesuffix(".weight"), tuple(hf_modules[j] for j in parts),
                                    parts, n_fused))
    if unused := [t for t in targets if t not in used]:
        raise ValueError(f"LoRA targets {unused} match no module of the mapping table; expected diffusers module "
                         f"names such as {list(FLOW_GRPO_TARGETS[:4])}")
    return found


def _kind(base: torch.nn.Module) -> str:
    if isinstance(base, ColumnParallelLinear):
        kind = COLUMN
    elif isinstance(base, RowParallelLinear):
        kind = ROW
    elif isinstance(base, torch.nn.Linear):
        return REPLICATED
    else:
        raise ValueError(f"LoRA wraps megatron-core ColumnParallelLinear / RowParallelLinear (local backend) or "
                         f"torch.nn.Linear; got {type(base).__name__}")
    if base.sequence_parallel:
        raise ValueError(f"LoRA does not support sequence parallelism; {type(base).__name__} has "
                         f"sequence_parallel=True")
    return kind


def _global_dims(base: torch.nn.Module, kind: str) -> tuple[int, int]:
    """(input features, output rows) of the whole base, before any TP split."""
    if kind == REPLICATED:
        return base.in_features, base.out_features
    return base.input_size, base.output_size


def _init_A(name: str, seed: int, rank: int, n_in: int) -> torch.Tensor:
    """peft's default A init, kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(I), 1/sqrt(I)), drawn over the global
    input from a generator keyed by (seed, diffusers name): equal at every TP size and on every rank."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    bound = n_in ** -0.5
    # drawn on the CPU (where the generator is) also inside a `with torch.device("cuda")` scope
    return (torch.rand(rank, n_in, generator=g, dtype=torch.float64, device="cpu") * 2 - 1).mul_(bound).float()


class LoRALinear(torch.nn.Module):
    """base(x) + (alpha / r) * B A x on a frozen base linear; returns what the base returns.

    Mirrors peft's ``lora.Linear`` (no dropout).  See the module docstring for the TP layout.
    """

    def __init__(self, base: torch.nn.Module, target: LoRATarget, rank: int, alpha: float, head_dim: int,
                 seed: int = 0):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be a positive int; got {rank!r}")
        self.base, self.target, self.kind = base, target, _kind(base)
        self.rank, self.alpha, self.scaling, self.head_dim = rank, alpha, alpha / rank, head_dim
        self.enabled = True
        self.tp_group = None if self.kind == REPLICATED else base.tp_group
        self.tp_rank, self.tp_size = (0, 1) if self.tp_group is None else (self.tp_group.rank(), self.tp_group.size())
        n_in, n_out = _global_dims(base, self.kind)
        rows = n_out // target.n_fused  # output rows of one part (H*D for q, k or v)
        if self.kind == COLUMN:
            rows //= self.tp_size
        a_PRI = torch.stack([_init_A(name, seed, rank, n_in) for name in target.hf])
        if self.kind == ROW:
            a_PRI = tp_shard(a_PRI, 2, self.tp_rank, self.tp_size)
        dtype = base.weight.dtype
        self.lora_A = torch.nn.Parameter(a_PRI.to(device=base.weight.device, dtype=dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(len(target.hf), rows, rank, device=base.weight.device,
                                                     dtype=dtype))
        # megatron's TP attributes on the split matrix (B of a column-parallel base, A of a row-parallel one): its
        # grad norm counts a tensor without them on TP rank 0 only, as a replica (the others' shards were missed)
        if self.kind == COLUMN:
            set_tensor_model_parallel_attributes(self.lora_B, True, 1, 1)
        elif self.kind == ROW:
            set_tensor_model_parallel_attributes(self.lora_A, True, 2, 1)

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *args, **kwargs):
        out = self.base(x, *args, **kwargs)
        if not self.enabled or self.merged_in_base(x):
            return out
        if self.kind == REPLICATED:
            return out + self.low_rank(x)
        y, bias = out
        return y + self.low_rank(x), bias

    def low_rank(self, x: torch.Tensor) -> torch.Tensor:
        """(alpha / r) * B A x with this rank's slice of the base's output layout."""
        group = self.tp_group
        if self.kind == ROW and not self.base.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, group=group)
        p, r = self.lora_A.shape[:2]
        h = torch.nn.functional.linear(x, self.lora_A.reshape(p * r, -1))
        if self.kind == COLUMN:
            h = copy_to_tensor_model_parallel_region(h, group=group)  # backward: sum the partial dh over TP
        elif self.kind == ROW:
            h = reduce_from_tensor_model_parallel_region(h, group=group)  # forward: sum A_local x_local over TP
        y = torch.nn.functional.linear(h, self._up_weight())
        if self.kind == COLUMN and self.base.gather_output:
            y = gather_from_tensor_model_parallel_region(y, group=group)
        return y

    def _up_weight(self) -> torch.Tensor:
        """(alpha / r) * B as ONE [O_local, P*r] matrix in the base's output layout: part j's rows read h's
        columns j*r:(j+1)*r (block-diagonal), fused QKV rows interleaved per head.  One GEMM then writes the
        adapter's output in place; a batched per-part product (einsum over p) made cuBLAS pick a kernel 15x
        slower than its traffic on an H200 at the rollout's 32 k tokens, plus an interleaving copy."""
        b_PoR = self.lora_B * self.scaling
        if b_PoR.shape[0] == 1:
            return self._fuse([b_PoR[0]], dim=0)
        return self._fuse(list(torch.block_diag(*b_PoR).chunk(b_PoR.shape[0], dim=0)), dim=0)

    def _fuse(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Place the adapter parts in the base's layout along ``dim``: as is for a plain linear; for a
        fused QKV, missing parts as zeros and rows interleaved per head exactly like the fused weight."""
        if self.target.n_fused == 1:
            return parts[0]
        full = [torch.zeros_like(parts[0]) for _ in range(self.target.n_fused)]
        for j, part in zip(self.target.parts, parts):
            full[j] = part
        heads = parts[0].shape[dim] // self.head_dim
        moved = [t.movedim(dim, 0) for t in full]
        return fuse_qkv(*moved, heads=heads).movedim(0, dim)

    # ---- merge and export ------------------------------------------------------------------------
    def merged_in_base(self, x: torch.Tensor) -> bool:
        """Whether the base's product of ``x`` already holds this adapter's output (the rollout engine's merged
        weights: ``model_specs.common.rollout_linear``)."""
        return isinstance(self.base, RolloutLinear) and self.base.adapter_merged(x)

    def delta_weight(self) -> torch.Tensor:
        """(alpha / r) * B A in the layout of this rank's base weight ([O_local, I] or [O, I_local])."""
        parts = [self.lora_B[j] @ self.lora_A[j] for j in range(self.lora_A.shape[0])]
        return self._fuse(parts, dim=0) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """W + (alpha / r) * B A of this rank's base in its dtype (the rollout's merged weight): one addmm of the
        up-projection the forward reads and the stacked A (every part's delta at once).  On a CPU the sum with W is
        rounded once; cuBLAS's 16-bit addmm rounds the product to W's dtype before adding W (on an H200 ~26 % of the
        merged bf16 values differ from the single rounding's, and 0.4-3 % of their FP8 codes: bench/RESULTS.md,
        2026-12-07), far below the FP8 copy's own rounding."""
        p, r = self.lora_A.shape[:2]
        w = self.base.weight
        return torch.addmm(w, self._up_weight().to(w.dtype), self.lora_A.reshape(p * r, -1).to(w.dtype))

    def peft_tensors(self, grad: bool = False) -> Iterator[tuple[str, torch.Tensor, int | None]]:
        """(peft name, this rank's tensor, TP-split dim or None) for each adapter matrix; its ``.grad``
        instead with ``grad=True`` (plain autograd; megatron DDP accumulates into ``main_grad`` instead)."""
        a_dim = 1 if self.kind == ROW else None
        b_dim = 0 if self.kind == COLUMN else None
        A, B = (self.lora_A.grad, self.lora_B.grad) if grad else (self.lora_A, self.lora_B)
        for j, name in enumerate(self.target.hf):
            yield f"{name}.lora_A.weight", A[j], a_dim
            yield f"{name}.lora_B.weight", B[j], b_dim

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """megatron dist-checkpoint entries: the base's under its original keys (no ``base.``), the
        adapters as ``<prefix>lora_A`` / ``lora_B`` split over TP along the dim they are split on here."""
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint, sharded_state_dict_default,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out = sharded_state_dict_default(self.base, prefix, sharded_offsets, metadata, tp_group=self.tp_group)
        axes = {COLUMN: {"lora_B": 1}, ROW: {"lora_A": 2}, REPLICATED: {}}[self.kind]
        adapters = {"lora_A": self.lora_A, "lora_B": self.lora_B}
        out.update(make_sharded_tensors_for_checkpoint(adapters, prefix, axes, sharded_offsets,
                                                       tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]))
        return out


# ---- whole-model operations ------------------------------------------------------------------------

def apply_lora(model: torch.nn.Module, rank: int, alpha: float, targets: Sequence[str], rules: Sequence[Rule],
               seed: int = 0) -> dict[str, LoRALinear]:
    """Freeze every parameter of ``model``, then wrap the linears ``targets`` select (through the mapping
    table ``rules``) in trainable ``LoRALinear``s.  Returns them by Megatron module name.

    Build DDP / the optimizer after this call so they see only the adapters as trainable.  A pipeline
    stage holds only its own blocks (named by global index): targets that live on other stages are
    theirs to wrap.
    """
    if lora_modules(model):
        raise ValueError("apply_lora: the model already has LoRA adapters; merge_lora() it first")
    model.requires_grad_(False)
    head_dim = model.config.kv_channels
    held = dict(model.named_modules())
    wrapped = {}
    for target in resolve_targets(rules, targets):
        parent_name, _, child = target.mcore.rpartition(".")
        if target.mcore not in held:
            continue
        parent = model.get_submodule(parent_name)
        wrapped[target.mcore] = LoRALinear(getattr(parent, child), target, rank, alpha, head_dim, seed)
        setattr(parent, child, wrapped[target.mcore])
    if not wrapped:
        raise ValueError(f"apply_lora: none of the linears {targets} select is in this model (or stage); "
                         f"expected the family's mapping table for this model")
    return wrapped


def lora_modules(model: torch.nn.Module) -> dict[str, LoRALinear]:
    return {target_name(name): m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def target_name(module_name: str) -> str:
    """A module name with LoRA's ``.base`` hops removed: the name in the plain model."""
    return module_name.replace(".base.", ".").removesuffix(".base")


def base_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The model's parameters under the plain model's names (``.base`` hops removed), adapters left out:
    what the mapping table names, with or without LoRA applied."""
    return {target_name(n): p for n, p in model.named_parameters() if not n.endswith((".lora_A", ".lora_B"))}


def base_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``base_parameters`` and the model's buffers (e.g. SD3's position table) under the plain model's names: every
    tensor a mapping table may name, for loading and syncing weights."""
    return {**base_parameters(model), **{target_name(n): b for n, b in model.named_buffers()}}


@contextlib.contextmanager
def disable_adapters(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run ``model`` as its frozen base (the reference policy of the KL term); yields the model."""
    modules = list(lora_modules(model).values())
    saved = [m.enabled for m in modules]
    for m in modules:
        m.enabled = False
    try:
        yield model
    finally:
        for m, was in zip(modules, saved):
            m.enabled = was


def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's state dict under the plain model's names with W + (alpha / r) B A in place of each
    wrapped weight (fused QKV layout, TP shards as the base holds them); no adapter tensors.  Feed it
    to the mapping table (``checkpoints_convert.mapping.to_hf``) for a merged export."""
    deltas = {f"{name}.weight": m.delta_weight().detach() for name, m in lora_modules(model).items()}
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith((".lora_A", ".lora_B")):
            continue
        name = target_name(name)
        state[name] = tensor + deltas[name].to(tensor.dtype) if name in deltas else tensor
    return state


@torch.no_grad()
def merge_lora(model: torch.nn.Module) -> torch.nn.Module:
    """Fold every adapter into its base weight and put the base linears back (plain names again)."""
    for name, m in lora_modules(model).items():
        m.base.weight.add_(m.delta_weight().to(m.base.weight.dtype))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, m.base)
    return model


def _gather(tensor: torch.Tensor, dim: int | None, group) -> torch.Tensor:
    if dim is None or group is None or group.size() == 1:
        return tensor.detach().clone()
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def peft_state_dict(model: torch.nn.Module, grad: bool = False) -> dict[str, torch.Tensor]:
    """The adapters as peft names them (``transformer_blocks.0.attn.to_q.lora_A.weight``), whole tensors
    gathered over TP (a collective: every TP rank must call it); their gradients with ``grad=True``."""
    return {name: _gather(t, dim, m.tp_group)
            for m in lora_modules(model).values() for name, t, dim in m.peft_tensors(grad)}


@torch.no_grad()
def load_peft_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load whole peft-named adapter tensors (as ``peft_state_dict`` returns them) into this rank's shards."""
    for m in lora_modules(model).values():
        for name, local, dim in m.peft_tensors():
            if name not in state:
                raise KeyError(f"adapter tensor {name!r} missing from the peft state (has {len(state)} tensors)")
            shard = tp_shard(state[name], dim, m.tp_rank, m.tp_size)
            if shard.shape != local.shape:
                raise ValueError(f"adapter tensor {name!r} has shape {tuple(state[name].shape)}; expected "
                                 f"{tuple(local.shape)} per TP rank at TP={m.tp_size}")
            local.copy_(shard)
