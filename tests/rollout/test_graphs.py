"""megatron_omni.rollout.graphs on the CPU: the inputs' structure it checks before any capture (the capture and the
replays themselves need a CUDA GPU: tests/rollout/test_graphs_gpu.py)."""
import dataclasses

import pytest
import torch

from megatron_omni.rollout.graphs import ReplayedForward, _flatten, _rebuild
from model_specs.qwen_image.conditioning import ModulationTable


def _table(n=3):
    return ModulationTable(torch.randn(n, 4), {0: (torch.randn(n, 24), torch.randn(n, 24))}, torch.randn(n, 8))


def test_flatten_and_rebuild_walk_a_familys_step_inputs():
    """The per-step conditioning (a dataclass of tensors in a dict of tuples) flattens to its tensors in order and
    a structure that compares equal across steps; rebuilt from other tensors, it keeps every plain value."""
    table = _table()
    args = ((torch.zeros(2, 5), (1, 4, 4), None), {"modulation": table.step(1), "scale": 2.0})
    leaves: list[torch.Tensor] = []
    spec = _flatten(args, leaves)
    assert [tuple(t.shape) for t in leaves] == [(2, 5), (1, 4), (1, 24), (1, 24), (1, 8)]
    again: list[torch.Tensor] = []
    assert _flatten(((torch.ones(2, 5), (1, 4, 4), None), {"modulation": table.step(2), "scale": 2.0}), again) == spec
    other: list[torch.Tensor] = []
    assert _flatten(((torch.ones(2, 5), (1, 4, 8), None), {"modulation": table.step(2), "scale": 2.0}), other) != spec
    copies = [t.clone() + 1 for t in leaves]
    (x, fhw, mask), kw = _rebuild(args, list(copies))
    assert x is copies[0] and fhw == (1, 4, 4) and mask is None and kw["scale"] == 2.0
    assert kw["modulation"].temb_NH is copies[1] and kw["modulation"].blocks[0] == (copies[2], copies[3])
    assert kw["modulation"].out_N2H is copies[4]


def test_a_call_of_another_structure_is_refused_before_any_capture():
    """The first call runs the forward as it is; a later call whose tensors have other shapes (or whose plain
    values differ) cannot replay that capture: ValueError naming the call, nothing captured."""
    seen = []
    replayed = ReplayedForward(lambda x, fhw: seen.append(fhw) or x * 2)
    assert torch.equal(replayed(torch.ones(2, 3), (1, 2, 2)), torch.full((2, 3), 2.0))
    with pytest.raises(ValueError, match="another structure at call 2"):
        replayed(torch.ones(4, 3), (1, 2, 2))
    with pytest.raises(ValueError, match="another structure at call 3"):
        replayed(torch.ones(2, 3), (1, 4, 4))
    assert seen == [(1, 2, 2)]


def test_rebuild_keeps_the_order_past_a_dataclass_field_outside_its_init():
    """A dataclass field that ``__init__`` does not take (computed in ``__post_init__``) still holds a flattened
    tensor: rebuilding consumes it in its place, so the tensors after it land where they belong."""
    @dataclasses.dataclass
    class Halves:
        full: torch.Tensor
        half: torch.Tensor = dataclasses.field(init=False)

        def __post_init__(self):
            self.half = self.full / 2

    obj = (Halves(torch.ones(2)), torch.zeros(3))
    leaves: list[torch.Tensor] = []
    _flatten(obj, leaves)
    assert [tuple(t.shape) for t in leaves] == [(2,), (2,), (3,)]
    copies = [torch.full((2,), 4.0), torch.full((2,), 9.0), torch.full((3,), 7.0)]
    rebuilt, tail = _rebuild(obj, list(copies))
    assert rebuilt.full is copies[0] and torch.equal(rebuilt.half, torch.full((2,), 2.0)) and tail is copies[2]
