"""bench/rollout_forward.py --smoke: the whole script (ours fused / unfused, with and without the per-step inputs,
diffusers' model beside it) on the family's tiny config on the CPU; the table has a row per variant and batch, and
the engine's fusions reach the family's blocks (times mean nothing there)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("family,fused,blocks", [("sd3", 9, 3), ("qwen_image", 6, 2)])
def test_smoke_prints_the_table(family, fused, blocks):
    """SD3's tiny config: 3 blocks, the last ``context_pre_only`` (no text MLP): 5 GELU MLPs take the fc1 epilogue
    path on the CPU, and 4 attentions the q / k norm kernel (3 joint, MMDiT-X's image-only one in its dual-attention
    block); Qwen-Image's 2 blocks: 4 MLPs and the 2 joint attentions."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "rollout_forward.py"), "--family", family, "--smoke",
                          "--repeats", "1", "--fusion", "fused", "unfused", "--modulation", "table", "computed"],
                         cwd=ROOT / "bench", capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert f"cpu (smoke: times mean nothing), {family} {blocks} blocks, torch.float32, 64x64" in text, text[-2000:]
    rows = {m.group(1).strip(): float(m.group(2)) for m in
            re.finditer(r"^(ours [^\d]+|diffusers)\s+2\s+([\d.]+)\s", text, re.M)}
    assert set(rows) == {"ours eager fused table", "ours eager fused", "ours eager unfused table",
                         "ours eager unfused", "diffusers"}, text[-2000:]
    assert all(ms > 0 for ms in rows.values())
    assert re.findall(r"^fused modules: (\d+)$", text, re.M) == [str(fused)] * 2, text[-2000:]


def test_smoke_alternates_fp8_arms():
    """``--fp8 handoff adaln handoff``: three runs in the named order, the repeated arm's rows numbered, and the
    adaLN arm's blocks (Qwen-Image's 2) on the one-pass FP8 input."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "rollout_forward.py"), "--smoke", "--repeats", "1",
                          "--no-reference", "--fp8", "handoff", "adaln", "handoff"],
                         cwd=ROOT / "bench", capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert re.findall(r"^--- (.*)$", text, re.M) == ["ours eager fp8-handoff fused table #1",
                                                     "ours eager fp8-adaln fused table",
                                                     "ours eager fp8-handoff fused table #2"], text[-2000:]
    assert re.findall(r"^blocks with the one-pass adaLN -> FP8 input: (\d+)$", text, re.M) == ["2"], text[-2000:]
    rows = re.findall(r"^(ours .+?)\s+2\s+([\d.]+)\s", text, re.M)
    assert [r[0].strip() for r in rows] == re.findall(r"^--- (.*)$", text, re.M), text[-2000:]


def test_refuses_what_cannot_run():
    run = [sys.executable, str(ROOT / "bench" / "rollout_forward.py"), "--family", "sd3", "--smoke", "--fusion",
           "qkv-sum"]
    out = subprocess.run(run, cwd=ROOT / "bench", capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--fusion qkv-sum patches Qwen-Image's attention; expected --family qwen_image, " \
                                   "got sd3" in out.stderr
    out = subprocess.run(run[:-2] + ["--fp8", "adaln", "--fusion", "unfused"], cwd=ROOT / "bench",
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--fp8 adaln runs the fused blocks' FP8 path; expected --fusion fused alone, " \
                                   "got ['unfused']" in out.stderr
    out = subprocess.run(run[:-2] + ["--adaln-launch", "4,8,false"], cwd=ROOT / "bench", capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "--adaln-launch 4,8,false sets the adaln arms' kernel; expected --fp8 adaln " \
                                   "too" in out.stderr
    out = subprocess.run(run[:-2] + ["--fp8", "adaln", "--adaln-launch", "3,8,false"], cwd=ROOT / "bench",
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "adaLN kernel launch '3,8,false': expected ROWS,WARPS,ROUND" in out.stderr
    out = subprocess.run(run[:-2] + ["--dynamic-text"], cwd=ROOT / "bench", capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "--dynamic-text times the graphs compiled with a dynamic text length; expected " \
                                   "--compile MODE too" in out.stderr


def test_smoke_dynamic_text_recompiles_before_timing():
    """``--compile default --dynamic-text``: one call a text token shorter before the timed calls makes dynamo
    recompile the blocks (their guard on the text length fails), as the RL step's second prompt length does."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "rollout_forward.py"), "--smoke", "--repeats", "1",
                          "--no-reference", "--no-eager", "--compile", "default", "--dynamic-text"],
                         cwd=ROOT / "bench", capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TORCH_LOGS": "recompiles"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "recompiled at 7 text tokens" in out.stdout and "8 text tokens (compiled graphs dynamic in it)" in out.stdout
    assert "Recompiling function run_blocks" in out.stderr and "cond.text_len == 8" in out.stderr, out.stderr[-3000:]


def test_smoke_fp8_variants():
    """--fp8 handoff plain: the FP8 linears switched, the MLPs fused (handoff) or left to megatron's forward (plain:
    Qwen-Image's 2 attentions stay fused); both rows in the table."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "rollout_forward.py"), "--family", "qwen_image",
                          "--smoke", "--repeats", "1", "--fp8", "handoff", "plain", "--no-reference"],
                         cwd=ROOT / "bench", capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert re.findall(r"^fused modules: (\d+)$", text, re.M) == ["6", "2"], text[-2000:]
    assert int(re.findall(r"^FP8 linears: (\d+)$", text, re.M)[0]) > 0
    rows = {m.group(1).strip() for m in re.finditer(r"^(ours .+?)\s+2\s+([\d.]+)\s", text, re.M)}
    assert rows == {"ours eager fp8-handoff fused table", "ours eager fp8-plain fused table"}, text[-2000:]
