"""Run logging: console progress, metrics.jsonl, wandb (offline by default), image grids and curves."""
from megatron_omni.logging.run_logger import RunLogger

__all__ = ["RunLogger"]
