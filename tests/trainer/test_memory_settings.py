"""Memory at scale as run settings (issue 21, part 3): activation recompute (train.recompute: megatron-core's
recompute_granularity / method / num_layers, model_specs.common.recompute), trajectories in host memory
(rollout.trajectories_on) and the text encoder + VAE offloaded while the policy trains (data.offload_encoders,
megatron_omni.trainer.offload): each gives the run's own numbers, and the estimate counts it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_omni.config import load_config
from megatron_omni.config.schema import ConfigError
from megatron_omni.trainer.loop import TIMING_METRICS as TIMING

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = ["train.steps=2", "train.save_every=0", "train.micro_batch_size=4", "train.global_batch_size=8",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.num_steps=4", "rollout.window_size=2",
        "algorithm.logprob_check_samples=4", "logging.wandb_mode=disabled", "model.arch.num_layers=4",
        "reward.workers=1"]


def _blocks_grads(single_rank, recompute: str, num_layers: int = 1):
    """A tiny Qwen-Image's loss, every parameter's gradient, and how often its blocks / core attentions ran."""
    from model_specs.common.recompute import apply_recompute, recompute_config
    from model_specs.qwen_image.config import tiny_config
    from model_specs.qwen_image.family import FAMILY

    arch = tiny_config(num_layers=4)
    torch.manual_seed(0)
    config = FAMILY.transformer_config(arch, 1, **recompute_config(recompute, num_layers))
    model = FAMILY.build(arch, config, single_rank.tp_group)
    calls = {"block": 0, "core_attention": 0}

    def counted(forward):
        def run(*args, **kwargs):
            calls["core_attention"] += 1
            return forward(*args, **kwargs)
        return run

    for name, m in model.blocks.named_modules():
        if name and "." not in name:  # a block: the runner calls it through __call__, hooks see every run
            m.register_forward_pre_hook(lambda *_: calls.__setitem__("block", calls["block"] + 1))
        if name.endswith("core_attention"):  # (the recompute calls its forward itself)
            m.forward = counted(m.forward)
    apply_recompute(model, config)
    g = torch.Generator().manual_seed(1)
    img = torch.randn(2, 16, arch.in_channels, generator=g)
    txt = torch.randn(2, 8, arch.joint_attention_dim, generator=g)
    target = torch.randn(2, 16, arch.out_channels * 4, generator=g)
    loss = ((model(img, txt, torch.tensor([0.7, 0.3]), (1, 4, 4)) - target) ** 2).mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, calls


@pytest.mark.parametrize("recompute,num_layers", [("full", 1), ("full", 3), ("selective", 1)])
def test_recompute_gives_the_same_loss_and_gradients(single_rank, recompute, num_layers):
    loss, grads, calls = _blocks_grads(single_rank, "none")
    assert calls == {"block": 4, "core_attention": 4}
    loss_r, grads_r, calls_r = _blocks_grads(single_rank, recompute, num_layers)
    # what ran again in the backward: every block (full) or every core attention (selective), once
    assert calls_r == ({"block": 8, "core_attention": 8} if recompute == "full" else
                       {"block": 4, "core_attention": 8})
    assert loss_r == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_r[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _train(state, overrides, out):
    from megatron_omni.data.tasks import build_task
    from megatron_omni.trainer.loop import train

    run, done = train(load_config("digits_flow_grpo", None, TINY + overrides), state, build_task("digits"), out)
    return run, [{k: v for k, v in m.items() if k not in TIMING} for m in done]


@pytest.mark.numerics
def test_loop_with_recompute_and_host_trajectories_equals_the_plain_run(single_rank, tmp_path):
    """The loop's metrics (losses, grad norms, log-prob check, rewards of the second step's rollout from the
    updated weights) with full recompute and host trajectories equal the plain run's within float32 rounding."""
    run, plain = _train(single_rank, [], tmp_path / "plain")
    assert plain[1]["grad_norm"] > 0 and run.policy.module.block_runner.recompute_layers is None
    for i, extra in enumerate((["train.recompute=full", "train.recompute_num_layers=2"],
                               ["train.recompute=selective"], ["rollout.trajectories_on=host"])):
        run, got = _train(single_rank, extra, tmp_path / f"run{i}")
        assert run.policy.module.block_runner.recompute_layers == (2 if i == 0 else None)  # the setting reached it
        _equal(got, plain, extra)


def _equal(got: list[dict], want: list[dict], what) -> None:
    assert [m["step"] for m in got] == [m["step"] for m in want] == [0, 1]
    for a, b in zip(got, want):
        for key in b:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (what, a["step"], key)


@pytest.mark.numerics
def test_lora_loop_with_full_recompute_equals_the_plain_lora_run(single_rank, tmp_path):
    """LoRA accumulates its adapters' gradients with one batched add per micro-batch (trainer/grad_flush.py);
    recomputed blocks give the same gradients there too."""
    lora = ["lora.rank=4", "lora.alpha=8", "train.lr=1e-3"]
    _, plain = _train(single_rank, lora, tmp_path / "plain")
    run, got = _train(single_rank, lora + ["train.recompute=full"], tmp_path / "full")
    assert run.policy.grad_flush is not None and plain[1]["grad_norm"] > 0
    _equal(got, plain, "lora + full recompute")


def test_settings_refuse_what_cannot_work():
    with pytest.raises(ConfigError, match="train.recompute_num_layers: 2 with train.recompute=selective"):
        load_config("digits_flow_grpo", None, ["train.recompute=selective", "train.recompute_num_layers=2"])
    with pytest.raises(ConfigError, match="recompute"):
        load_config("digits_flow_grpo", None, ["train.recompute=everything"])
    with pytest.raises(ConfigError, match="trajectories_on"):
        load_config("digits_flow_grpo", None, ["rollout.trajectories_on=disk"])
    with pytest.raises(ConfigError, match="data.offload_encoders: true with data.task='digits'"):
        load_config("digits_flow_grpo", None, ["data.offload_encoders=true"])


def test_microbatches_reach_the_device_one_at_a_time():
    """OnDevice moves every tensor of a micro-batch (dataclass fields, dicts, lists) as an iterator reaches it;
    the meta device stands in for a GPU."""
    from megatron_omni.trainer.offload import OnDevice

    @dataclasses.dataclass
    class MB:
        x: torch.Tensor
        extras: dict | None
        rows: tuple
        scale: float = 1.0

    mbs = [MB(torch.ones(2), {"pooled": torch.zeros(3)}, (torch.ones(1), None), 2.0) for _ in range(3)]
    lazy = OnDevice(mbs, torch.device("meta"))
    assert len(lazy) == 3 and all(mb.x.device.type == "cpu" for mb in mbs)  # nothing moved yet
    moved = next(iter(lazy))
    assert moved.x.is_meta and moved.extras["pooled"].is_meta and moved.rows[0].is_meta and moved.rows[1] is None
    assert moved.scale == 2.0 and mbs[0].x.device.type == "cpu"


class _Recorder(torch.nn.Module):
    """Records .to() calls instead of moving (a CPU stands in for a host beside a GPU)."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def to(self, device):
        self.log.append(str(device))
        return self


def test_parts_offload_switches_once_each_way():
    from megatron_omni.trainer.offload import PartsOffload

    log = []
    encoder = type("Encoder", (), {})()
    encoder.model, encoder.device = _Recorder(log), torch.device("cuda")
    vae = type("VAE", (), {})()
    vae.models, vae.device = [_Recorder(log), _Recorder(log)], torch.device("cuda")  # a list: SD3's encoders
    offload = PartsOffload([encoder, vae], "cuda")
    encode = offload.wrap(lambda prompts: len(prompts))
    assert encode(["a"]) == 1 and log == []  # on the device already
    offload.offload()
    offload.offload()  # parked twice: moved once
    assert log == ["cpu"] * 3
    assert encode(["a", "b"]) == 2 and encode(["c"]) == 1
    assert log == ["cpu"] * 3 + ["cuda"] * 3  # back once, at the first encode
    cpu = PartsOffload([encoder], "cpu")
    cpu.offload()
    assert cpu.wrap(lambda: 7)() == 7 and len(log) == 6  # a CPU run moves nothing


def test_estimate_counts_recompute_host_trajectories_and_offload(tmp_path):
    from megatron_omni.trainer.memory import estimate

    base = ["parallel.tp=1", "parallel.cp=1", "parallel.ulysses=1"]
    plain = estimate(load_config("qwen_image_full", None, base), 1)
    full = estimate(load_config("qwen_image_full", None, base + ["train.recompute=full"]), 1)
    sbh = 192 * 1 * 3072  # 64 image + 128 text tokens, b = 1, hidden 3072
    # 60 block inputs kept in 16-bit, plus one block's whole count while the backward recomputes it
    assert full.parts["activations (1 micro-batch)"] == pytest.approx(60 * 2 * sbh + 34 * sbh)
    four = estimate(load_config("qwen_image_full", None, base + ["train.recompute=full",
                                                                 "train.recompute_num_layers=4"]), 1)
    assert four.parts["activations (1 micro-batch)"] == pytest.approx(15 * 2 * sbh + 4 * 34 * sbh)
    selective = estimate(load_config("qwen_image_full", None, base + ["train.recompute=selective"]), 1)
    assert selective.parts["activations (1 micro-batch)"] == plain.parts["activations (1 micro-batch)"]
    host = estimate(load_config("qwen_image_full", None, base + ["rollout.trajectories_on=host"]), 1)
    assert plain.parts["trajectories"] > 0 and host.parts["trajectories (in host memory)"] == 0
    assert plain.total - host.total == pytest.approx(plain.parts["trajectories"])
    # a pipeline folder's text encoder + VAE: counted whole, or with offload only beyond the activations
    folder = tmp_path / "pipe"
    for sub, size in (("text_encoder", 3 << 30), ("vae", 1 << 20)):
        (folder / sub).mkdir(parents=True)
        with open(folder / sub / "model.safetensors", "wb") as f:
            f.truncate(size)
    cfg = load_config("qwen_image_full", None, base)
    kept = estimate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(folder)),
                                        data=dataclasses.replace(cfg.data, task="pipeline")), 1)
    parked = estimate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(folder)),
                                          data=dataclasses.replace(cfg.data, task="pipeline", offload_encoders=True)),
                      1)
    files = (3 << 30) + (1 << 20)
    assert kept.parts["text encoder + VAE"] == files
    act = parked.parts["activations (1 micro-batch)"]
    assert parked.parts["text encoder + VAE (offloaded: beyond the activations)"] == pytest.approx(max(0, files - act))
