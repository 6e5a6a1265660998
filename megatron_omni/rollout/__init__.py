"""Rollout: sigma schedules, samplers with log-probs (ODE, SDE, CPS, Dance-SDE) and rollout engines."""
