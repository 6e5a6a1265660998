"""Backend choice for the tensor-parallel linears."""
import importlib.util

import pytest
from megatron_omni.parallel.linears import ColumnParallelLinear, RowParallelLinear

from model_specs.common.backends import linear_backend

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.skipif(HAVE_TE, reason="transformer_engine is installed here")
def test_without_transformer_engine_auto_is_local_and_te_is_refused():
    # megatron-core's TE extension imports even without TE (mock classes): auto must not pick those
    backend = linear_backend("auto")
    assert (backend.name, backend.column, backend.row) == ("local", ColumnParallelLinear, RowParallelLinear)
    with pytest.raises(ValueError, match="transformer_engine is not installed"):
        linear_backend("te")


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown backend 'tee'; expected one of \('auto', 'local', 'te'\)"):
        linear_backend("tee")
