"""Weight sync over a dedicated gloo group: a TP=2 trainer (2 ranks, rank 0 sends) pushes to two engine
processes; then two pipeline stages (simulated: each rank keeps half the model) send their own parts.
One launch runs every case (a launch costs seconds, a case a fraction of that)."""
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
    # engine 1 exits in the middle of a sync: the trainer gets an error within the timeout, no hang
    assert out["killed"].startswith(("weight sync", "engine process")), out["killed"]
    assert out["killed_seconds"] < TIMEOUT_S + 30

    # PP=2 (simulated): each stage streams its own blocks under global names; together, every tensor once
    stage0, stage1 = out["pp2"], out1["pp2"]
    assert stage0["equal"] == [True, True]
    assert sorted(stage0["plan"] + stage1["plan"]) == stage0["all"] and len(stage0["all"]) == 77
    assert all(".0." in n or not n.startswith("transformer_blocks") for n in stage0["plan"])
    assert "proj_out.weight" in stage1["plan"] and "time_text_embed.timestep_embedder.linear_1.weight" in stage0["plan"]
