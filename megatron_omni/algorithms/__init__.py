"""RL algorithms for flow-matching DiTs, one folder each on the ``Algorithm`` interface (``base``), found by name
through ``registry``; shared parts: group advantages (``advantages``).  The sampler math is the rollout's
(``megatron_omni.rollout.samplers``)."""
from megatron_omni.algorithms.registry import algorithm_names, get_algorithm

__all__ = ["algorithm_names", "get_algorithm"]
