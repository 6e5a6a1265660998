"""The ``sync`` section of a run config: defaults and the errors a user can cause."""
import pytest

from megatron_omni.config import load_config
from megatron_omni.config.schema import ConfigError


def test_defaults_keep_the_engine_in_process():
    s = load_config("digits_flow_grpo").sync
    assert (s.engine_placement, s.mode, s.bucket_mb, s.checksum) == ("in_process", "auto", 1024, False)


@pytest.mark.parametrize("overrides, mode", [([], "full"), (["lora.rank=4"], "lora"), (["sync.mode=merged", "lora.rank=4"], "merged"),
                                             (["sync.mode=lora", "lora.rank=4"], "lora")])
def test_auto_sends_adapters_only_when_lora_is_on(overrides, mode):
    cfg = load_config("digits_flow_grpo", None, overrides)
    assert cfg.sync.resolved_mode(cfg.lora.rank) == mode


@pytest.mark.parametrize("overrides, message", [
    (["sync.bucket_mb=0"], "sync.bucket_mb: expected an integer >= 1, got 0"),
    (["sync.timeout_s=0"], "sync.timeout_s: expected > 0 seconds"),
    (["sync.engine_placement=colocated", "sync.num_engines=2"], "sync.num_engines: 2 with engine_placement=colocated"),
    (["sync.engine_placement=process", "parallel.pp=2"], "sync.engine_placement: process with parallel.pp=2"),
    (["sync.mode=lora"], "sync.mode: lora with lora.rank=0: there are no LoRA adapters to send"),
    (["sync.mode=merged"], "sync.mode: merged with lora.rank=0: there are no LoRA adapters to merge"),
    (["sync.mode=full", "lora.rank=4"], "sync.mode: full with lora.rank=4 sends the frozen base only"),
    (["sync.mode=delta"], "sync.mode"),
])
def test_bad_sync_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config("digits_flow_grpo", None, overrides)
