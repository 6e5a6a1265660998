"""SRPO / Direct-Align: the loss and its gradient by hand (with and without the negative prompt), the refusal of a
reward without gradients (at config time and at the loss), the digit CNN's differentiable scores equal to its
reward, the training rows drawn from the seed, and the loss inside megatron's forward_backward_func equal to plain
autograd."""
import pytest
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_omni.algorithms.srpo import ALGORITHM as SRPO, SRPOLossConfig, srpo_loss, srpo_microbatches, srpo_rows
from megatron_omni.config import ConfigError, load_config
from megatron_omni.parallel import cuda_factories_on_cpu
from megatron_omni.rollout.engine import Request, Trajectory
from tests.algorithms.models import lora_model
from tests.qwen_image_reference import rel_err, tiny_config

pytestmark = pytest.mark.numerics
SCALE = 1.5
WEIGHTS = {"pos a": [0.5, -1.0], "pos b": [2.0, 0.25], "neg a": [0.1, 0.3], "neg b": [-0.4, 0.2]}


def _linear_reward(x0_hat, prompts):
    """r(x | p) = Σ_e w_p[e]·x[e]: its gradient in x̂0 is w_p."""
    w = torch.tensor([WEIGHTS[p] for p in prompts], dtype=x0_hat.dtype)
    return (x0_hat.flatten(1) * w).sum(dim=1)


V, X_T, X0, T = [[0.3, -0.2], [1.0, 0.5]], [[0.5, 0.4], [-0.3, 0.2]], [[0.4, 0.5], [-0.6, -0.1]], [0.6, 0.8]


@pytest.mark.parametrize("negative", [["neg a", "neg b"], None], ids=["positive-minus-negative", "positive-only"])
def test_loss_and_gradient_by_hand(negative):
    v = torch.tensor(V, dtype=torch.float64, requires_grad=True)
    loss, metrics = srpo_loss(v, torch.tensor(X_T), torch.tensor(X0), torch.tensor(T), _linear_reward,
                              ["pos a", "pos b"], negative, SRPOLossConfig(reward_scale=SCALE))
    loss.backward()
    x0_hat = [[X_T[i][e] - T[i] * V[i][e] for e in range(2)] for i in range(2)]
    pos = [sum(WEIGHTS[p][e] * x0_hat[i][e] for e in range(2)) for i, p in enumerate(["pos a", "pos b"])]
    neg = [0.0, 0.0] if negative is None else [sum(WEIGHTS[p][e] * x0_hat[i][e] for e in range(2))
                                               for i, p in enumerate(negative)]
    assert loss.item() == pytest.approx(-SCALE * ((pos[0] - neg[0]) + (pos[1] - neg[1])) / 2, rel=1e-6)
    assert metrics["srpo_reward"].item() == pytest.approx(sum(pos) / 2, rel=1e-6)
    assert metrics["srpo_negative"].item() == pytest.approx(sum(neg) / 2, abs=1e-7)
    mse = sum((x0_hat[i][e] - X0[i][e]) ** 2 for i in range(2) for e in range(2)) / 4
    assert metrics["recovery_mse"].item() == pytest.approx(mse, rel=1e-6)
    for i, (p, n) in enumerate(zip(["pos a", "pos b"], negative or [None, None])):
        for e in range(2):  # dL/dv = scale·t·(w⁺ − w⁻)/B
            w = WEIGHTS[p][e] - (0.0 if n is None else WEIGHTS[n][e])
            assert v.grad[i, e].item() == pytest.approx(SCALE * T[i] * w / 2, rel=1e-6)


def test_a_reward_without_gradient_is_refused():
    with pytest.raises(ConfigError, match=r"algorithm.srpo: reward.name='jpeg_compressibility' has no gradient.*"
                                          r"one of \['digit_classifier', 'latent_scorer'\]"):
        load_config("digits_flow_grpo", None, ["algorithm.name=srpo", "reward.name=jpeg_compressibility"])
    v = torch.zeros(2, 2, requires_grad=True)
    with pytest.raises(ValueError, match="the reward's score has no gradient"):  # a scorer that leaves autograd
        srpo_loss(v, torch.zeros(2, 2), torch.zeros(2, 2), torch.tensor([0.5, 0.5]),
                  lambda x, p: torch.from_numpy(x.detach().numpy().sum(1)), ["a", "b"], None, SRPOLossConfig())
    for bad, match in (("algorithm.srpo.timestep_range=[0.0,0.5]", "timestep_range"),
                       ("algorithm.srpo.timesteps_per_sample=0", "timesteps_per_sample"),
                       ("algorithm.srpo.reward_scale=0", "reward_scale")):
        with pytest.raises(ConfigError, match=match):
            load_config("digits_flow_grpo", None, ["algorithm.name=srpo", bad])


def test_digit_cnn_scores_with_gradients():
    from megatron_omni.rewards import build_reward

    reward = build_reward("digit_classifier")
    images = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    prompts = ["a handwritten digit seven", "a handwritten digit zero", "a handwritten digit three"]
    scores = reward.differentiable_scores(images, prompts)
    assert torch.allclose(scores.double(), torch.from_numpy(reward(images.detach(), prompts, None)), atol=1e-6)
    scores.sum().backward()
    assert images.grad.abs().sum() > 0
    assert all(p.grad is None for p in reward.model.parameters())  # the reward model is not trained


def _trajs(arch, n=3):
    g = torch.Generator().manual_seed(4)
    return [Trajectory(Request(prompt=f"pos {'ab'[i % 2]}", seed=i, img_fhw=(1, 4, 4)),
                       torch.randn(5, 16, arch.in_channels, generator=g, dtype=torch.float64), torch.linspace(1, 0, 5),
                       torch.zeros(4), torch.zeros(4, dtype=torch.bool)) for i in range(n)]


def test_rows_are_drawn_from_the_seed_in_the_range():
    arch = tiny_config()
    trajs = _trajs(arch)
    rows = srpo_rows(trajs, 2, (0.6, 0.9))
    assert [i for i, _, _ in rows] == [0, 0, 1, 1, 2, 2] and all(0.6 <= t <= 0.9 for _, t, _ in rows)
    again = srpo_rows(trajs, 2, (0.6, 0.9))
    assert all(a[1] == b[1] and torch.equal(a[2], b[2]) for a, b in zip(rows, again))  # a resume redraws them
    assert len({t for _, t, _ in rows}) == 6


def test_loss_in_forward_backward_matches_plain_autograd(single_rank):
    """A nonlinear reward (tanh of a fixed projection, prompt-dependent) and its negative prompt."""
    arch = tiny_config()
    model = lora_model(arch, single_rank.tp_group)
    trajs = _trajs(arch)
    g = torch.Generator().manual_seed(9)
    text = {p: (torch.randn(4 + k, arch.joint_attention_dim, generator=g, dtype=torch.float64), None)
            for k, p in enumerate(["pos a", "pos b"])}
    proj = {p: 0.05 * torch.randn(16 * arch.in_channels, generator=g)  # small: tanh far from saturating
            for p in ["pos a", "pos b", "not pos a", "not pos b"]}

    def reward(x0_hat, prompts):
        return torch.stack([torch.tanh(x.flatten() @ proj[p]) for x, p in zip(x0_hat, prompts)])

    mbs = srpo_microbatches(trajs, text, reward, timesteps=2, t_range=(0.5, 0.9), positive="{prompt}",
                            negative="not {prompt}", size=4)  # 6 rows: micro-batches of 4 and 2
    assert mbs[0].negative == ["not pos a", "not pos a", "not pos b", "not pos b"]
    cfg = load_config("digits_flow_grpo", None, ["algorithm.name=srpo", f"algorithm.srpo.reward_scale={SCALE}"])
    model.zero_grad(set_to_none=True)
    with cuda_factories_on_cpu():
        metrics = get_forward_backward_func()(
            forward_step_func=SRPO.forward_step(cfg, None), data_iterator=iter(mbs), model=model,
            num_microbatches=len(mbs), seq_length=1, micro_batch_size=4)
    megatron = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    losses = []
    for mb in mbs:
        v = model(mb.x_t.double(), mb.txt.double(), mb.t, mb.img_fhw, mb.txt_mask).float()
        x0_hat = mb.x_t.float() - mb.t.float().view(-1, 1, 1) * v
        losses.append(-SCALE * (reward(x0_hat, mb.positive) - reward(x0_hat, mb.negative)).mean())
    (sum(losses) / len(mbs)).backward()
    errs = {n: rel_err(megatron[n], p.grad) for n, p in model.named_parameters() if p.requires_grad}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-6, (worst, errs[worst])
    assert sum(p.grad.norm() for p in model.parameters() if p.requires_grad) > 0
    for m, loss in zip(metrics, losses):
        assert m["loss"].item() == pytest.approx(loss.item(), rel=1e-5)


def test_rollouts_are_ode_with_final_samples_only():
    from types import SimpleNamespace

    from megatron_omni.data.tasks import build_task

    cfg = load_config("digits_flow_grpo", None, ["algorithm.name=srpo"])
    run = SimpleNamespace(cfg=cfg, task=build_task("digits"), family=cfg.model.family_impl)
    reqs = SRPO.requests(run, 0)
    assert len(reqs) == 64 and all(r.sampler == "ode" and r.window_size is None for r in reqs)
    spec = SRPO.record_spec(cfg)
    assert not spec.log_probs and not spec.step_latents
