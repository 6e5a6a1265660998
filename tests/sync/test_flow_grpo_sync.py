"""The FlowGRPO loop with its rollout engine in a separate process (sync.engine_placement=process): the
weights cross a gloo group every step, and the run is the in-process run bit for bit."""
import json

import torch

from megatron_omni.config import load_config
from megatron_omni.data.tasks import build_task
from megatron_omni.trainer.flow_grpo import train
from tests.trainer.test_flow_grpo import TIMING, TINY


def _metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def test_engine_in_a_separate_process_gives_the_same_run(tmp_path, single_rank):
    torch.set_num_threads(1)  # the engine process computes with one thread: so does the in-process engine here
    task = build_task("digits")
    tiny = TINY + ["train.steps=2", "lora.rank=4"]
    train(load_config("digits_flow_grpo", None, tiny), single_rank, task, tmp_path / "in_process")
    cfg = load_config("digits_flow_grpo", None, tiny + ["sync.engine_placement=process", "sync.bucket_mb=1",
                                                       "sync.checksum=true", "sync.timeout_s=60"])
    _, done = train(cfg, single_rank, task, tmp_path / "process")
    assert all(m["sync_seconds"] > 0 for m in done)
    assert _metrics(tmp_path / "process") == _metrics(tmp_path / "in_process")
