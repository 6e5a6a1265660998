"""Weight sync over a dedicated gloo group: a TP=2 trainer (2 ranks, rank 0 sends) pushes to two engine
processes; an engine that dies mid-sync fails the sync on both trainer ranks, and restarted engines sync
again.  One launch runs every case (a launch costs seconds, a case a fraction of that).  Pipeline
stages as senders: test_pp_sync.py."""
from megatron_omni.parallel.testing import run_distributed
from tests.sync.workers import TIMEOUT_S, tp2_trainer


def test_tp2_trainer_to_two_engines(tmp_path):
    out, out1 = run_distributed(tp2_trainer, world_size=2, args=(str(tmp_path / "die"),), parallel={"tp": 2},
                                timeout_s=240)
    for case in ("merged_1MiB", "merged_16KiB", "full_64KiB"):
        assert out[case]["equal"] == [True, True], case  # every engine tensor == the trainer's HF export, bit for bit
        assert out[case]["tensors"] == 77
    # a bucket smaller than the largest tensor (384 KiB): tensors are chunked over buckets
    assert out["merged_16KiB"]["largest"] > 16 << 10 and out["merged_16KiB"]["buckets"] > 77
    # a wrong shape is refused by both engines, naming the tensor; their weights stay as they were
    assert "'time_text_embed.timestep_embedder.linear_1.weight' has shape (127, 256); the engine expects (128, 256)" \
        in out["wrong_shape"], out["wrong_shape"]
    assert out["unchanged"] == [True, True]
    # engine 1 exits in the middle of a sync: both trainer ranks get the error at once (the surviving
    # engine, stuck in the broken group, is not waited for), no hang
    for side in (out, out1):
        assert side["killed"].startswith(("weight sync", "engine process")), side["killed"]
        assert side["killed_seconds"] < TIMEOUT_S, side["killed_seconds"]
    # restarted engines (a new group) get the whole model again
    assert out["restarted"]["equal"] == [True, True]
