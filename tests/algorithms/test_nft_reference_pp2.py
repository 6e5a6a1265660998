"""DiffusionNFT's reference term (``algorithm.diffusion_nft.ref_weight > 0``) at PP=2 on 2 gloo ranks against the
single-process run (test_loop_layouts' shrunk digits run, its helpers and float32 tolerances).  The single process
runs the reference inline in each training forward; under PP v_ref comes from a forward-only pass of the schedule
before training with the reference's weights on every chunk (DiffusionNFT.reference_weights): full fine-tuning swaps
the initial weights in (here beside the EMA old policy, both in the run's NFTState), LoRA switches the adapters off.
8 samples x 2 timesteps = 16 rows, one optimizer step per RL step.  Step 0 trains at the initial weights (v_θ = v_ref:
ref_loss 0); step 1's ref_loss and its gradient are the reference's."""
from __future__ import annotations

import pytest

from tests.trainer.test_loop_layouts import TINY

pytestmark = [pytest.mark.numerics, pytest.mark.slow]  # slow: not rerun under avx2 (make test)

NFT = TINY + ["algorithm.name=diffusion_nft", "algorithm.diffusion_nft.timesteps_per_sample=2",
              "algorithm.diffusion_nft.ref_weight=0.5"]
CASES = {"full_ema": ["algorithm.diffusion_nft.old_policy=ema", "algorithm.diffusion_nft.ema_decay=0.5"],
         "lora": ["lora.rank=4", "lora.alpha=8", "train.lr=1e-3"]}


@pytest.fixture(scope="module")
def at_pp2(tmp_path_factory):
    from tests.trainer.test_kl_layouts import layouts_and_one_process

    return layouts_and_one_process({n: (NFT + o, {"pp": 2}) for n, o in CASES.items()}, tmp_path_factory.mktemp("nft"))


@pytest.mark.parametrize("name", list(CASES))
def test_nft_reference_at_pp2_equals_one_process(at_pp2, name):
    from tests.trainer.test_kl_layouts import layout_equals_one_process

    single = layout_equals_one_process(*at_pp2[name])
    assert single[0]["ref_loss"] == 0 and single[1]["ref_loss"] > 0 and single[1]["grad_norm"] > 0
    assert all(m["optimizer_steps"] == 1 for m in single)


def test_nft_checkpoint_at_one_process_resumes_at_pp2(tmp_path):
    """Full fine-tuning with the reference term and the EMA old policy, killed in one process after step 1 (checkpoint
    after step 0: the EMA's entries, no initial weights), resumed at PP2 (NFTState: the EMA loaded, the reference pass's
    initial weights the run's own, its seed): steps 1 and 2 equal the uninterrupted single-process run's."""
    from tests.trainer.test_kl_layouts import _close_steps, resumed_at_pp2

    whole, resumed = resumed_at_pp2(NFT + CASES["full_ema"], tmp_path)
    assert whole[2]["ref_loss"] > 0
    _close_steps(resumed, whole[1:])
