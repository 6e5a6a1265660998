"""torch.compile of the blocks (rollout no_grad with the engine's inference fusions, and LoRA training forward +
backward) equals eager, with no graph break (a break leaves the element-wise work around it unfused;
megatron-core's row-parallel linear used to cause one per call)."""
import pytest
import torch
from torch._dynamo.utils import counters

from checkpoints_convert.qwen_image import qwen_image_rules
from megatron_omni.compile import compile_blocks, traceable_dgrad_allreduce
from megatron_omni.config import ConfigError, load_config
from model_specs.common.block_runner import BlockRunner, run_blocks
from model_specs.common.fusion import fuse_inference
from model_specs.common.lora import FLOW_GRPO_TARGETS, apply_lora
from model_specs.qwen_image.config import tiny_config
from model_specs.qwen_image.model import QwenImageModel
from model_specs.qwen_image.spec import qwen_image_block_spec


def _lora_model(arch, tp_group):
    """The tiny model at this TP size with LoRA on the FlowGRPO targets, B nonzero (the adapters change the
    output); the same weights at every call."""
    torch.manual_seed(0)
    model = QwenImageModel(arch, arch.transformer_config(tp_group.size(), params_dtype=torch.float32), tp_group,
                           qwen_image_block_spec("local"))
    apply_lora(model, 4, 8.0, FLOW_GRPO_TARGETS, qwen_image_rules(arch), seed=0)
    for m in (mod for mod in model.modules() if hasattr(mod, "lora_B")):
        torch.nn.init.normal_(m.lora_B, std=0.02, generator=torch.Generator().manual_seed(2))
    return model


def _inputs(arch):
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 16, arch.in_channels, generator=g), torch.randn(2, 8, arch.joint_attention_dim, generator=g)


@pytest.mark.numerics
@pytest.mark.parametrize("layers, per_graph", [(2, 1), (3, 2)])
def test_compiled_blocks_equal_eager_rollout_and_lora_training(single_rank, layers, per_graph):
    """One block per graph, and two (3 blocks: a slice of 2, then a slice of 1)."""
    arch = tiny_config(num_layers=layers)
    model, compiled = _lora_model(arch, single_rank.tp_group), _lora_model(arch, single_rank.tp_group)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), compiled.parameters()))
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(compiled, "default", blocks_per_graph=per_graph)
    assert fuse_inference(compiled) == 3 * arch.num_layers  # the rollout engine's fused MLPs and attentions
    img, txt = _inputs(arch)
    sigma, mask = torch.tensor([0.3, 0.8]), torch.tensor([[True] * 8, [True] * 5 + [False] * 3])
    with torch.no_grad():  # the rollout's graph
        torch.testing.assert_close(compiled(img, txt, sigma, (1, 4, 4), mask), model(img, txt, sigma, (1, 4, 4), mask),
                                   rtol=1e-5, atol=1e-6)
    grads = []
    for m in (model, compiled):  # the trainer's graph: forward + backward through AOTAutograd
        m.zero_grad()
        m(img, txt, sigma, (1, 4, 4), mask).square().mean().backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    # 12 targets = 8 linears per block (q, k, v fused; add_q, add_k, add_v fused), A and B each
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 8 * layers
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_block_runner_runs_the_blocks_in_order_a_slice_per_call():
    slices = []

    def fn(blocks, hidden, cond, modulations):
        slices.append([m for m in modulations])
        return run_blocks(blocks, hidden, cond, modulations)

    blocks = [lambda h, cond, m, k=k: h * 10 + k + cond * m for k in range(1, 6)]
    assert BlockRunner(fn, per_call=2)(blocks, 0, 1, [0, 0, 0, 0, 0]) == 12345
    assert BlockRunner(fn, per_call=2)(blocks, 0, 1, [0, 0, 0, 0, 5]) == 12350  # block i gets modulations[i]
    assert slices[:3] == [[0, 0], [0, 0], [0]]
    with pytest.raises(ValueError, match="4 modulations for 5 blocks"):
        BlockRunner()(blocks, 0, 0, [None] * 4)


def test_slices_of_blocks_share_one_graph(single_rank):
    """Parameters are graph inputs: 4 blocks 2 per graph compile one graph, run twice (a guard on which blocks a
    slice holds would compile two)."""
    arch = tiny_config(num_layers=4)
    model = _lora_model(arch, single_rank.tp_group)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(model, "default", blocks_per_graph=2)
    img, txt = _inputs(arch)
    with torch.no_grad():
        model(img, txt, torch.tensor([0.3, 0.8]), (1, 4, 4))
    assert counters["stats"]["unique_graphs"] == 1 and counters["stats"]["calls_captured"] > 0


def test_compile_mode_is_checked():
    with pytest.raises(ValueError, match="compile mode 'fast'"):
        compile_blocks(torch.nn.Module(), "fast")
    with pytest.raises(ValueError, match="has no .blocks run by a .block_runner"):
        compile_blocks(torch.nn.Module(), "default")
    with pytest.raises(ValueError, match="blocks per call 0; expected an integer >= 1"):
        BlockRunner(per_call=0)
    with pytest.raises(ConfigError, match=r"train.compile: 'fast' is not a torch.compile mode"):
        load_config(overrides=["train.compile=fast"])
    assert load_config(overrides=["rollout.compile=default"]).rollout.compile == "default"


def test_compile_switches_on_coordinate_descent_tuning(monkeypatch):
    """compile_blocks turns on inductor's tuning of its Triton kernels, unless the environment sets it."""
    import torch._inductor.config as inductor

    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
            self.block_runner = BlockRunner()

    monkeypatch.setattr(inductor, "coordinate_descent_tuning", False)
    monkeypatch.setenv("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "0")
    compile_blocks(Blocks(), "default")
    assert inductor.coordinate_descent_tuning is False
    monkeypatch.delenv("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING")
    compile_blocks(Blocks(), "default")
    assert inductor.coordinate_descent_tuning is True


def _column_switched_vs_megatron(state):
    """A column-parallel linear switched by ``traceable_dgrad_allreduce`` against megatron-core's default at TP=2:
    (was it async before, is it now, [output, input, weight and bias gradients equal]) with and without
    gather_output."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    config = tiny_config().transformer_config(2, params_dtype=torch.float32)
    out = []
    for gather in (False, True):
        kw = dict(config=config, init_method=config.init_method, bias=True, gather_output=gather,
                  tp_group=state.tp_group)
        torch.manual_seed(0)
        switched, theirs = ColumnParallelLinear(16, 8, **kw), ColumnParallelLinear(16, 8, **kw)
        switched.load_state_dict(theirs.state_dict())
        before = switched.allreduce_dgrad
        assert traceable_dgrad_allreduce(switched) == 1
        x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(1))
        results = []
        for layer in (switched, theirs):
            a = x.clone().requires_grad_()
            y, _ = layer(a)
            (y * torch.arange(y.numel()).view_as(y)).sum().backward()  # a different upstream gradient per column
            results.append((y.detach(), a.grad, layer.weight.grad, layer.bias.grad))
        out.append((before, switched.allreduce_dgrad, [torch.equal(p, q) for p, q in zip(*results)]))
    return out


def _tp2_compiled_vs_eager(state):
    """At TP=2 (gloo): the LoRA model's compiled blocks against eager, forward + backward; graph breaks counted."""
    arch = tiny_config(num_layers=2)
    model, compiled = _lora_model(arch, state.tp_group), _lora_model(arch, state.tp_group)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(compiled, "default")
    img, txt = _inputs(arch)
    outs, grads = [], []
    for m in (model, compiled):
        out = m(img, txt, torch.tensor([0.3, 0.8]), (1, 4, 4), None)
        out.square().mean().backward()
        outs.append(out.detach())
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    errors = {n: ((grads[1][n] - g0).norm() / g0.norm()).item() for n, g0 in grads[0].items()}
    return (_column_switched_vs_megatron(state), ((outs[1] - outs[0]).norm() / outs[0].norm()).item(), errors,
            {k: dict(v) for k, v in counters.items()})


@pytest.mark.numerics
def test_compiled_blocks_at_tp2_have_no_graph_break():
    """megatron-core's column-parallel linear all-reduces its input gradient with async_op=True, which dynamo
    cannot trace (a break at every column-parallel linear: 30 for these 2 blocks); compile_blocks switches it to
    megatron's traceable path for the same sum."""
    from megatron_omni.parallel.testing import run_distributed

    for columns, out_err, grad_errs, stats in run_distributed(_tp2_compiled_vs_eager, 2, parallel={"tp": 2},
                                                              timeout_s=600):
        for before, after, equal in columns:
            assert (before, after) == (True, False)  # the premise: upstream all-reduces inside its function
            assert all(equal), equal
        assert out_err < 1e-5
        assert len(grad_errs) == 2 * 8 * 2 and max(grad_errs.values()) < 1e-5, grad_errs
        assert not stats.get("graph_break"), stats["graph_break"]
        # one graph per block kind: block 0's input needs no gradient (the embedders are frozen), block 1's does
        assert stats["stats"]["unique_graphs"] == 2, stats["stats"]
