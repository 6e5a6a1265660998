"""Our RowParallelLinear: megatron-core's, minus the per-call DeprecationWarning (a torch.compile graph break)."""
import warnings

import torch
from megatron.core.tensor_parallel import RowParallelLinear as MegatronRowParallelLinear

from megatron_omni.parallel.linears import RowParallelLinear


def _pair(state, frozen: bool):
    from model_specs.qwen_image.config import tiny_config

    config = tiny_config().transformer_config(1, params_dtype=torch.float32)
    kw = dict(config=config, init_method=config.output_layer_init_method, bias=True, input_is_parallel=True,
              skip_bias_add=False, tp_group=state.tp_group)
    ours, theirs = RowParallelLinear(16, 8, **kw), MegatronRowParallelLinear(16, 8, **kw)
    theirs.load_state_dict(ours.state_dict())
    for layer in (ours, theirs):
        layer.requires_grad_(not frozen)
    return ours, theirs


def test_row_parallel_matches_megatron_and_does_not_warn(single_rank):
    x = torch.randn(5, 3, 16)
    for frozen in (False, True):  # megatron's trainable and frozen-weight matmul paths
        ours, theirs = _pair(single_rank, frozen)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            theirs_out, _ = theirs(x.clone().requires_grad_())
        # the premise: upstream warns on every call (if this fails, megatron-core fixed it and the subclass can go)
        assert any("tp_group is None" in str(w.message) for w in caught)
        a = x.clone().requires_grad_()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours_out, _ = ours(a)
        assert not [w for w in caught if "tp_group" in str(w.message)]
        assert torch.equal(ours_out, theirs_out)
        b = x.clone().requires_grad_()
        theirs(b)[0].square().sum().backward()
        ours_out.square().sum().backward()
        assert torch.equal(a.grad, b.grad)
        if not frozen:
            assert torch.equal(ours.weight.grad, theirs.weight.grad)
