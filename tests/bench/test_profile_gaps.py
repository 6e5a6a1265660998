"""bench/_profile.idle_gaps: the GPU's idle gaps between kernels, charged to the host op that ended each one."""
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _profile import idle_gaps  # noqa: E402

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def _evt(name, start, end, device=CPU, parent=None):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                           cpu_parent=parent)


def test_gaps_are_charged_to_the_innermost_host_op_running_when_they_end(capsys):
    step = _evt("optimizer.step", 0, 1000)
    add = _evt("aten::add_", 400, 460, parent=step)
    events = [step, add, _evt("loss", 1000, 1300),
              _evt("k1", 0, 100, CUDA), _evt("k2", 90, 300, CUDA),  # overlapping kernels: no gap
              _evt("k3", 450, 500, CUDA),  # 150 us idle, ended while aten::add_ ran
              _evt("k4", 505, 600, CUDA),  # a 5 us gap: under the threshold
              _evt("k5", 1200, 1250, CUDA)]  # 600 us idle, ended while "loss" ran
    idle = idle_gaps(events, min_us=10.0)
    out = capsys.readouterr().out
    assert abs(idle - 0.75) < 1e-9
    assert "0.6 ms  loss" in out and "0.1 ms  aten::add_ < optimizer.step" in out
    assert "over 2 gaps" in out


def test_events_with_equal_ranges(capsys):
    """A host op and its one child often share their time range to the microsecond; so can two kernels."""
    parent = _evt("aten::linear", 0, 50)
    events = [parent, _evt("aten::addmm", 0, 50, parent=parent), _evt("k1", 0, 10, CUDA), _evt("k2", 0, 10, CUDA),
              _evt("k3", 40, 45, CUDA)]
    assert abs(idle_gaps(events) - 0.03) < 1e-9
    assert "aten::addmm < aten::linear" in capsys.readouterr().out


def test_no_kernels_no_idle():
    assert idle_gaps([_evt("aten::mm", 0, 10)]) == 0.0
