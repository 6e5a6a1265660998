"""Layouts that cannot work are refused up front, with the numbers that do not fit (single process)."""
import pytest

from megatron_omni.config.schema import ConfigError, ParallelConfig, RunConfig
from megatron_omni.parallel.pipeline import stage_layers
from model_specs.qwen_image.config import tiny_config


@pytest.mark.parametrize("call, message", [
    (lambda: ParallelConfig(cp=4, ulysses=3).validate(), "parallel.ulysses: 3 does not divide parallel.cp=4"),
    (lambda: ParallelConfig(tp=2, cp=2, pp=2).data_parallel_size(12),
     "world size 12 is not a multiple of tp*cp*pp = 2*2*2 = 8"),
    (lambda: ParallelConfig(cp=4).check_image_tokens(30), "30 image tokens do not split over cp=4"),
    (lambda: ParallelConfig(pp=4, vpp=2).check_microbatches(2), "needs >= pp=4 micro-batches per step, got 2"),
    (lambda: stage_layers(5, 2, 0), "num_layers=5 does not split evenly over pp*vpp = 2*1 = 2"),
    (lambda: stage_layers(4, 2, 0, layout=[1, 2]), "pipeline layout [1, 2] must give each of the pp*vpp = 2"),
])
def test_bad_layouts_name_the_numbers(call, message):
    with pytest.raises((ConfigError, ValueError), match=message.replace("*", r"\*").replace("[", r"\[")):
        call()


def test_run_config_checks_heads_and_layers():
    cfg = RunConfig()
    cfg.model.arch = tiny_config(num_layers=6)  # 4 heads
    cfg.parallel = ParallelConfig(tp=2, cp=4, ulysses=4)
    with pytest.raises(ConfigError, match=r"tp\*ulysses = 2\*4 does not divide num_attention_heads=4"):
        cfg.validate()
    cfg.parallel = ParallelConfig(pp=2, vpp=2)
    with pytest.raises(ConfigError, match="num_layers=6 does not split over pp\\*vpp = 4"):
        cfg.validate()
    assert ParallelConfig(tp=2, cp=2, pp=2).data_parallel_size(16) == 2


def test_stage_layers_even_interleaved_and_by_layout():
    assert [stage_layers(8, 2, r, 2, v) for v in range(2) for r in range(2)] == [
        range(0, 2), range(2, 4), range(4, 6), range(6, 8)]  # chunk = vpp_rank * pp + pp_rank
    assert [stage_layers(4, 2, r, layout=[1, 3]) for r in range(2)] == [range(0, 1), range(1, 4)]
