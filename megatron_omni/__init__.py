"""megatron-omni: RL post-training for diffusion transformers and omni models on megatron-core."""
import warnings

# Upstream notices that say nothing about a user's run, silenced once for every process that imports
# us (spawned ranks included): megatron-core's fallbacks to torch kernels when Transformer Engine /
# Apex / absl are absent (expected on CPU; the backend chosen is reported by model_specs.common.backends),
# and deprecation notes from megatron-core and torch.distributed.checkpoint internals we do not call directly.
for _message in (r"Transformer Engine and Apex are not installed", r"absl\.logging is not installed",
                 r"full scope is deprecated", r"torch\.distributed is disabled, unavailable or uninitialized",
                 r"The argument order of load has been changed", r"When using async grad allreduce",
                 r"`torch\.distributed\.all_gather_into_tensor` is deprecated", r"Apex is not installed",
                 r"MimoModelConfig is experimental"):
    warnings.filterwarnings("ignore", message=_message)
