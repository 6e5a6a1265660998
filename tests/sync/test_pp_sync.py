"""Weight sync from the real pipeline-parallel trainer (each rank builds only its stage) to two engine
processes over a gloo group: stage 0 drives the engines, stage 1 joins as a second sender.  PP=2 and
TP=2 x PP=2 on 4 ranks, one launch; the engines must end up with the HF weights bit for bit, also
after they are restarted."""
import pytest

from megatron_omni.parallel.testing import run_distributed
from tests.qwen_image_reference import diffusers_reference
from tests.sync.workers import ARCH, PP_LAYOUTS, pp_trainer


@pytest.mark.numerics
def test_pp_trainer_to_two_engines():
    # the reference is diffusers' own state dict, built here: the trainer's stages are loaded from it
    ref = diffusers_reference(ARCH).state_dict()
    per_rank = run_distributed(pp_trainer, world_size=4, args=(ref,), timeout_s=240)
    for layout in PP_LAYOUTS:
        out = per_rank[0][layout]
        stage1 = per_rank[2][layout]
        if layout == PP_LAYOUTS[0]:
            assert out["before"] == [True, True]  # the engines started from other weights
        # every engine tensor equals the full model's HF export, bit for bit: the diffusers weights
        # (full), and W + (alpha/r) B A of the trainer's adapters (merged; at TP=2 the trainer multiplies
        # the shards, the reference the whole matrices: equal to float32 rounding, tests/sync/workers.py)
        for mode in ("full", "merged"):
            assert out[mode]["differing"] == [[], []], (layout, mode, out[mode]["differing"])
            # the stages' plans are disjoint and name every tensor once
            plans = out["plan"][mode] + stage1["plan"][mode]
            assert sorted(plans) == sorted(ref) and len(plans) == 77, layout
        assert all(n.startswith("transformer_blocks.1.") or not n.startswith("transformer_blocks")
                   for n in stage1["plan"]["full"])
        assert out["adapted"] == 24  # W + alpha/r B A differs from W in each adapted weight (12 per block)
        # a bucket smaller than the largest tensor: tensors are chunked over buckets
        assert out["merged"]["largest"] > 16 << 10
        assert all(side["merged"]["buckets"] > side["merged"]["tensors"] for side in (out, stage1))
        # a wrong shape in stage 1's plan is refused by both engines (sync ranks 2 and 3), before any
        # byte moves, on both senders; the engines keep the weights of the sync before
        for side in (out, stage1):
            msg = side["wrong_shape"]
            for rank in (2, 3):
                assert f"sync rank {rank}: tensor 'norm_out.linear.weight' has shape (255, 128); the engine " \
                       f"expects (256, 128)" in msg, (layout, msg)
        assert out["unchanged"] == [[], []], layout
    # engines restarted (as after a failed sync) start from other weights on a new group; stage 1
    # reconnects to its address, and the next full sync gives them the HF weights again
    restarted = per_rank[0][PP_LAYOUTS[-1]]["restarted"]
    assert restarted["before"] == [True, True] and restarted["differing"] == [[], []]
