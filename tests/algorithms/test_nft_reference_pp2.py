"""DiffusionNFT's reference term (``algorithm.diffusion_nft.ref_weight > 0``) at PP=2 on 2 gloo ranks against the
single-process run (test_loop_layouts' shrunk digits run, its helpers and float32 tolerances).  The single process
runs the reference inline in each training forward; under PP v_ref comes from a forward-only pass of the schedule
before training with the reference's weights on every chunk (DiffusionNFT.reference_weights): full fine-tuning swaps
the initial weights in (here beside the EMA old policy, both in the run's NFTState), LoRA switches the adapters off.
8 samples x 2 timesteps = 16 rows, one optimizer step per RL step.  Step 0 trains at the initial weights (v_θ = v_ref:
ref_loss 0); step 1's ref_loss and its gradient are the reference's."""
from __future__ import annotations

import pytest

from megatron_omni.parallel.testing import run_distributed
from tests.trainer.test_loop_layouts import TINY, _close, _train

pytestmark = [pytest.mark.numerics, pytest.mark.slow]  # slow: not rerun under avx2 (make test)

NFT = TINY + ["algorithm.name=diffusion_nft", "algorithm.diffusion_nft.timesteps_per_sample=2",
              "algorithm.diffusion_nft.ref_weight=0.5"]
CASES = {"full_ema": ["algorithm.diffusion_nft.old_policy=ema", "algorithm.diffusion_nft.ema_decay=0.5"],
         "lora": ["lora.rank=4", "lora.alpha=8", "train.lr=1e-3"]}


@pytest.mark.parametrize("name", list(CASES))
def test_nft_reference_at_pp2_equals_one_process(tmp_path, name):
    from megatron_omni.parallel.state import destroy_parallel, init_parallel

    overrides = NFT + CASES[name]
    state = init_parallel(tp=1, seed=0, device="cpu")
    try:
        single = _train(state, overrides, tmp_path / "single")
    finally:
        destroy_parallel()
    assert single[0]["ref_loss"] == 0 and single[1]["ref_loss"] > 0 and single[1]["grad_norm"] > 0
    assert all(m["optimizer_steps"] == 1 for m in single)
    ranks = run_distributed(_train, world_size=2, parallel={"pp": 2}, args=(overrides + ["parallel.pp=2"],
                                                                           tmp_path / "pp2"), timeout_s=600)
    assert ranks[0] == ranks[1]
    _close(ranks[0], single)


def test_nft_checkpoint_at_one_process_resumes_at_pp2(tmp_path):
    """Full fine-tuning with the reference term and the EMA old policy, killed in one process after step 1 (checkpoint
    after step 0: the EMA's entries, no initial weights), resumed at PP2 (NFTState: the EMA loaded, the reference pass's
    initial weights the run's own, its seed): steps 1 and 2 equal the uninterrupted single-process run's."""
    from megatron_omni.parallel.state import destroy_parallel, init_parallel
    from tests.trainer.test_kl_layouts import _close_steps
    from tests.trainer.test_loop_layouts import _killed, _resumed

    three = [o for o in NFT + CASES["full_ema"] if not o.startswith(("train.steps", "train.save_every"))] + [
        "train.steps=3", "train.save_every=1"]
    state = init_parallel(tp=1, seed=0, device="cpu")
    try:
        whole = _train(state, three, tmp_path / "whole")
        assert _killed(state, three, tmp_path / "run") == "0"
    finally:
        destroy_parallel()
    ranks = run_distributed(_resumed, world_size=2, parallel={"pp": 2}, args=(three + ["parallel.pp=2"],
                                                                               tmp_path / "run"), timeout_s=600)
    assert ranks[0] == ranks[1] and [m["step"] for m in ranks[0]] == [1, 2] and whole[2]["ref_loss"] > 0
    _close_steps(ranks[0], whole[1:])
