"""DiffusionNFT: the negative-aware flow-matching loss (``loss``), its micro-batches and forward step (``step``) and
the algorithm (``algorithm.ALGORITHM``)."""
from megatron_omni.algorithms.diffusion_nft.algorithm import ALGORITHM, DiffusionNFT, NFTState
from megatron_omni.algorithms.diffusion_nft.loss import NFTLossConfig, diffusion_nft_loss
from megatron_omni.algorithms.diffusion_nft.step import (NFTMicroBatch, nft_forward_step, nft_microbatches,
                                                         training_rows, with_old_velocity,
                                                         with_reference_velocity)

__all__ = ["ALGORITHM", "DiffusionNFT", "NFTLossConfig", "NFTMicroBatch", "NFTState", "diffusion_nft_loss",
           "nft_forward_step", "nft_microbatches", "training_rows", "with_old_velocity", "with_reference_velocity"]
