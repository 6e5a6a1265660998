"""bench/idle_trace.py on a hand-written Chrome trace: each idle gap is charged to what the thread that launched the
next kernel was doing when the GPU ran dry (or counted as a device-side wait when that launch came earlier), and
the synchronising runtime calls are listed."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _op(cat, name, tid, ts, dur, correlation=None):
    event = {"ph": "X", "cat": cat, "name": name, "pid": 1 if cat != "kernel" else 0, "tid": tid, "ts": ts, "dur": dur}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def test_gaps_are_charged_to_the_launching_threads_work(tmp_path):
    events = [
        _op("cpu_op", "autograd::engine::evaluate_function", 2, 0, 400),
        _op("cpu_op", "aten::_cudnn_attention_backward", 2, 120, 200),  # busy when the GPU runs dry at t=110
        _op("cuda_runtime", "cudaLaunchKernel", 2, 1, 1, correlation=1),
        _op("cuda_runtime", "cudaLaunchKernel", 2, 300, 1, correlation=2),  # late: 190 us after the GPU ran dry
        _op("cuda_runtime", "cudaLaunchKernel", 2, 5, 1, correlation=3),  # early: the kernel waited on the device
        _op("cuda_runtime", "cudaStreamSynchronize", 1, 500, 70),
        _op("kernel", "gemm", 7, 10, 100, correlation=1),
        _op("kernel", "cudnn_bwd", 7, 310, 50, correlation=2),
        _op("kernel", "cast", 7, 400, 20, correlation=3),
    ]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "idle_trace.py"), str(trace), "--min-us", "20"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "idle 0.2 ms in 2 gaps" in lines[0] and "device-side waits) 0.0 ms (1)" in lines[0], lines[0]
    # the gap 110 -> 310 us: the autograd thread was in the engine (the attention op began only at 120)
    assert lines[2].split() == ["0.2", "1", "[tid", "2]", "autograd::engine::evaluate_function"], lines
    # made by the attention backward's host path
    assert lines[4].split()[1:] == ["[tid", "2]", "aten::_cudnn_attention_backward", "<",
                                    "autograd::engine::evaluate_function"], lines
    assert lines[6].split() == ["0.1", "1", "[tid", "1]", "cudaStreamSynchronize"], lines
