"""bench/ab.py runs bench/flow_grpo_step.py's arms in alternation, each a process of its own, and prints one table:
every run's phases and the arms' medians; a run past --timeout is stopped and named; bad arms are refused by name.
bench/flow_grpo_step.py --constant sets a module-level constant before anything is built."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import ab
    import flow_grpo_step

    return ab, flow_grpo_step


def test_rounds_alternate_the_order_and_bad_arms_are_refused_by_name(bench):
    ab, _ = bench
    assert ab.run_order(["new", "control"], 3) == [(0, "new"), (0, "control"), (1, "control"), (1, "new"),
                                                     (2, "new"), (2, "control")]
    assert ab.parse_arm("control=--constant m.X=256 --set 'a.b=c d'") == (
        "control", ["--constant", "m.X=256", "--set", "a.b=c d"])
    assert ab.parse_arm("new=") == ("new", [])
    for bad in ("new", "=--fp8", "a/b=--fp8", "x=--set 'unclosed"):
        with pytest.raises(ValueError, match=re.escape(f"--arm {bad!r}")):
            ab.parse_arm(bad)


def test_constants_are_set_by_module_path_or_refused_by_name(bench, monkeypatch):
    _, flow_grpo_step = bench
    from model_specs.common import fp8

    monkeypatch.setattr(fp8, "MIN_ROWS", fp8.MIN_ROWS)  # restored after the test
    assert flow_grpo_step.set_constant("model_specs.common.fp8.MIN_ROWS=256") is None and fp8.MIN_ROWS == 256
    assert "is a bool; model_specs.common.fp8.MIN_ROWS is a int (256)" in \
        flow_grpo_step.set_constant("model_specs.common.fp8.MIN_ROWS=True")
    assert "has no constant 'MIN_ROW'" in flow_grpo_step.set_constant("model_specs.common.fp8.MIN_ROW=1")
    assert "module 'model_specs.common.fp9' does not import" in \
        flow_grpo_step.set_constant("model_specs.common.fp9.MIN_ROWS=1")
    assert "expected MODULE.NAME=VALUE" in flow_grpo_step.set_constant("MIN_ROWS=1")
    assert fp8.MIN_ROWS == 256  # a refused value leaves the constant as it was


def test_two_arms_run_in_turn_and_one_table_holds_their_runs_and_medians(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "ab.py"), "--arm", "a=", "--arm",
           "b=--constant model_specs.common.fp8.MIN_ROWS=256", "--rounds", "1", "--log-dir", str(tmp_path), "--",
           "--smoke", "--steps", "1", "--warmup", "0", "--skip-reference"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "bench/ab.py on cpu: --smoke --steps 1 --warmup 0 --skip-reference" in out.stdout
    rows = re.findall(r"^│ (\S+)\s*│ ([^│]+?)\s*│\s*([0-9.]+) │\s*([0-9.]+) │", out.stdout, re.M)
    assert [r[:2] for r in rows] == [("1", "a"), ("1", "b"), ("median", "a (1 run)"),
                                     ("median", next(r[1] for r in rows if r[1].startswith("b (1 run; DiT side")))]
    assert re.search(r"b \(1 run; DiT side [+-][0-9.]+% vs a\)", out.stdout), out.stdout[-3000:]
    for arm, extra in (("a", []), ("b", ["--constant", "model_specs.common.fp8.MIN_ROWS=256"])):
        record = json.loads((tmp_path / f"1-{arm}.json").read_text())
        assert record["argv"] == ["--smoke", "--steps", "1", "--warmup", "0", "--skip-reference", *extra, "--json",
                                  str(tmp_path / f"1-{arm}.json")]
        # the constant as the run ended with it (set in that process); the other arm names none
        assert record["constants"] == ({"model_specs.common.fp8.MIN_ROWS": 256} if extra else {})
        ours = record["loops"][0]
        assert ours["error"] is None and ours["images"] == 4 and ours["last"]["logprob_pearson"] > 0.999
        assert ours["seconds"]["dit"] == pytest.approx(sum(ours["seconds"][k] for k in ("rollout_sampling", "train",
                                                                                         "sync")))
        assert "ours step 0:" in (tmp_path / f"1-{arm}.log").read_text()
    # --resume with a second round: round 1 is read from the folder, round 2 runs (b first: the order alternates)
    (tmp_path / "1-b.log").write_text("")  # a re-run would write it again
    out = subprocess.run([*cmd[:cmd.index("--rounds") + 1], "2", "--resume", *cmd[cmd.index("--rounds") + 2:]],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert re.findall(r"round (\d), (\w): (read|/)", out.stdout) == [("1", "a", "read"), ("1", "b", "read"),
                                                                     ("2", "b", "/"), ("2", "a", "/")], out.stdout
    assert (tmp_path / "1-b.log").read_text() == "" and (tmp_path / "2-a.json").exists()
    assert re.search(r"│ median │ a \(2 runs\)", out.stdout) and re.search(r"│ median │ b \(2 runs; DiT", out.stdout)


def test_a_run_past_the_timeout_is_stopped_and_named(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "ab.py"), "--arm", "a=", "--arm", "b=", "--rounds", "1", "--timeout",
           "2", "--log-dir", str(tmp_path), "--", "--smoke"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, (out.stdout + out.stderr)[-3000:]
    assert re.findall(r"^│ 1\s*│ (\w)\s*│ stopped after 2 s", out.stdout, re.M) == ["a", "b"], out.stdout[-3000:]
    assert "bench/ab.py on no run finished" in out.stdout


def test_a_run_json_cut_short_or_missing_is_run_again_and_an_error_row_is_kept(bench, tmp_path):
    """--resume reads a finished run's JSON; one cut short (a run stopped while it wrote) or missing reads as not
    run, and a run that ended in an error row (out of memory) reads as that error, not retried."""
    ab, _ = bench
    cut = tmp_path / "1-a.json"
    cut.write_text('{"argv": ["--smoke"], "loops": [')
    assert ab.read_run(cut) is None and ab.read_run(tmp_path / "2-a.json") is None
    cut.write_text(json.dumps({"argv": [], "device": "cpu", "steps": 1, "constants": {},
                               "loops": [{"name": "ours: megatron-omni train's rl_step", "error": "out of memory"}]}))
    assert ab.read_run(cut) == {"error": "out of memory"}
