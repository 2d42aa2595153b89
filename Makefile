# LongStraw: `make demo` runs the main job on its embedded default; `make test` runs ruff and the CPU suite.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: torch setup test demo

# torch is installed only where it is missing (never replace a user's torch), pinned to the CPU build that lies on
# the test machines
torch:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"

# Installs into the current Python what the suite needs. No fla on CPU (tests/conftest.py keeps it out: with
# triton installed it breaks transformers there). triton itself runs our kernels in its interpreter on CPU.
setup: torch
	$(PIP) install -q -e ".[test,plot,math]"

# the linter first: it takes a second, the suite minutes. The CPU suite runs with any GPU hidden, as on a machine
# without one: tests/conftest.py turns on Triton's interpreter (our kernels on CPU tensors) and keeps fla out only
# where CUDA is absent. The GPU suite is `pytest -q -m gpu tests` (docs/guide/code.md)
test: setup
	$(PYTHON) -m ruff check .
	CUDA_VISIBLE_DEVICES= $(PYTHON) -m pytest -q tests

# the default job (qwen36_tiny, a synthetic task, CPU) needs the package and its core dependencies only: none of the
# test extras (deepspeed, triton, transformers, torchao, ...); memory.png is drawn where matplotlib is installed
demo: torch
	$(PIP) install -q -e .
	$(PYTHON) -m longstraw_cli train
