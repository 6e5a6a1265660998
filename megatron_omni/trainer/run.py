"""`megatron-omni train`: bring up the parallel groups and the task, check they fit the model, run the loop."""
from __future__ import annotations

from megatron_omni.config.schema import RunConfig
from megatron_omni.data.tasks import Task, task_for
from megatron_omni.parallel.state import destroy_parallel, init_parallel
from megatron_omni.trainer.memory import check_fits, device_memory, estimate


def check_task_fits(cfg: RunConfig, task: Task) -> None:
    family, arch = cfg.model.family_impl, cfg.model.arch
    channels = family.latent_channels(arch)
    if channels != task.latent_channels:
        raise ValueError(f"task {task.name!r} has {task.latent_channels} packed latent channels; the model "
                         f"(model.arch) takes and predicts {channels}: expected {task.latent_channels}")
    if family.text_dim(arch) != task.text_dim:
        raise ValueError(f"task {task.name!r} encodes prompts to width {task.text_dim}; the model (model.arch) takes "
                         f"text of width {family.text_dim(arch)}: expected them to match")


def check_loop_layout(cfg: RunConfig) -> None:
    """The loop runs at DP x TP x CP (Ulysses x ring) x PP (x vpp): every rank's in-process engine holds the whole
    model (tests/trainer/test_loop_layouts.py).  Not yet: PP with engine processes."""
    p = cfg.parallel
    if p.pp > 1 and cfg.sync.engine_placement != "in_process":
        raise ValueError(f"parallel.pp={p.pp} with sync.engine_placement={cfg.sync.engine_placement!r}: engine "
                         f"processes take their weights from trainer rank 0, which holds one stage; expected "
                         f"sync.engine_placement=in_process under pipeline parallelism")


def check_data_parallel(cfg: RunConfig, dp: int) -> None:
    """ValueError before anything is built when the step's prompt groups or its optimizer steps' pairs do not
    split over ``dp`` data-parallel replicas (megatron_omni.trainer.data_parallel)."""
    r, t = cfg.rollout, cfg.train
    if r.prompts_per_step % dp:
        raise ValueError(f"rollout.prompts_per_step={r.prompts_per_step} prompt groups per RL step over {dp} "
                         f"data-parallel replicas; expected a multiple of {dp}")
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ValueError(f"train.global_batch_size={t.global_batch_size} pairs per optimizer step over {dp} "
                         f"data-parallel replicas of train.micro_batch_size={t.micro_batch_size}; expected a "
                         f"multiple of {t.micro_batch_size * dp}")


def check_device_fits(cfg: RunConfig, state) -> None:
    """On an accelerator, refuse before anything is built a layout whose memory estimate cannot fit the device
    (megatron_omni.trainer.memory.check_fits); nothing on a CPU."""
    if device_bytes := device_memory(state):
        check_fits(estimate(cfg, state.world_size, state=state), device_bytes)


def run_training(cfg: RunConfig, resume: bool = False) -> list[dict]:
    from megatron_omni.trainer.loop import train

    check_loop_layout(cfg)
    state = init_parallel(tp=cfg.parallel.tp, cp=cfg.parallel.cp, pp=cfg.parallel.pp, vpp=cfg.parallel.vpp,
                          ulysses=cfg.parallel.ulysses, seed=cfg.train.seed, device=cfg.parallel.device)
    try:
        check_data_parallel(cfg, state.dp)
        check_device_fits(cfg, state)
        task = task_for(cfg, state.torch_device)
        check_task_fits(cfg, task)
        _, done = train(cfg, state, task, cfg.train.output_dir, resume=resume)
        return done
    finally:
        destroy_parallel()
