# Two commands on a fresh machine:  `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv if needed and install the project into it.
#
# CPU machines get torch 2.13.0 (CPU build); on a machine with an NVIDIA driver the venv sees the
# system site-packages so the user's own CUDA torch is used (GPU users bring their own torch).

VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check
STAMP  := $(VENV)/.megatron-omni-installed
APT    := DEBIAN_FRONTEND=noninteractive apt-get install -y -q
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=

.PHONY: demo test test-gpu check-wheel install clean-venv

install: $(STAMP)

$(STAMP): setup.py Makefile
	@test -x $(PY) || python3 -m venv $(if $(HAS_GPU),--system-site-packages) $(VENV)
	$(PIP) install --upgrade pip
	@if [ -z "$(HAS_GPU)" ]; then $(PIP) install torch==2.13.0; \
	 else $(PY) -c "import torch; assert torch.cuda.is_available(), 'GPU machine: install a CUDA torch first'"; fi
	$(PIP) install numpy "packaging>=24.2" psutil triton
	# megatron-core 0.19.2 declares Python>=3.12 but its megatron/core runs on 3.11: install it by hand.
	$(PIP) install --no-deps --ignore-requires-python megatron-core==0.19.2
	# The OCR reward reads with Debian's tesseract (engine + English model); apt-get it when missing and root.
	@command -v tesseract >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { $(APT) tesseract-ocr || { apt-get update -q && $(APT) tesseract-ocr; }; } || \
	  echo "NOTE: tesseract-ocr is missing (the OCR reward needs it; its tests skip): sudo apt-get install tesseract-ocr"; }
	$(PIP) install -e ".[dev]"
	@touch $@

demo: $(STAMP)
	$(PY) -m megatron_omni.cli demo

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)
	ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q -m "numerics and not slow" $(PYTEST_ARGS)
	$(MAKE) --no-print-directory check-wheel

# The wheel as a user installs it: built, installed (not editable) into a fresh venv beside .venv's pinned
# dependencies, run from outside the checkout (tests/packaging/check_wheel.py).
check-wheel: $(STAMP)
	$(PY) tests/packaging/check_wheel.py

# GPU-only tests (marker `gpu`); on a machine without a GPU they skip themselves.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
