"""The ``sync`` section of a run config: defaults and the errors a user can cause."""
import pytest

from megatron_omni.config import load_config
from megatron_omni.config.schema import ConfigError


def test_defaults_keep_the_engine_in_process():
    s = load_config("digits_flow_grpo").sync
    assert (s.engine_placement, s.mode, s.bucket_mb, s.checksum) == ("in_process", "auto", 1024, False)


@pytest.mark.parametrize("overrides, message", [
    (["sync.bucket_mb=0"], "sync.bucket_mb: expected an integer >= 1, got 0"),
    (["sync.timeout_s=0"], "sync.timeout_s: expected > 0 seconds"),
    (["sync.engine_placement=colocated", "sync.num_engines=2"], "sync.num_engines: 2 with engine_placement=colocated"),
    (["sync.engine_placement=process", "parallel.pp=2"], "sync.engine_placement: process with parallel.pp=2"),
])
def test_bad_sync_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config("digits_flow_grpo", None, overrides)
