"""Rollout: sigma schedules, samplers with log-probs (ODE, SDE, CPS, Dance-SDE) and rollout engines."""
from megatron_omni.rollout.engine import EmbeddedEngine, EngineConfig, Request, RolloutEngine, Trajectory
from megatron_omni.rollout.samplers import cfg_combine, log_prob, rollout, step_mean_std
from megatron_omni.rollout.schedule import sde_window, sigmas

__all__ = ["EmbeddedEngine", "EngineConfig", "Request", "RolloutEngine", "Trajectory", "cfg_combine", "log_prob",
           "rollout", "step_mean_std", "sde_window", "sigmas"]
