# LongStraw: `make demo` runs the main job on its embedded default; `make test` runs ruff and the CPU suite.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: setup test demo

# Installs into the current Python. torch is installed only where it is missing (never replace a user's torch),
# pinned to the CPU build that lies on the test machines; no fla on CPU (tests/conftest.py keeps it out: with
# triton installed it breaks transformers there). triton itself runs our kernels in its interpreter on CPU.
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	$(PIP) install -q -e ".[test,plot,math]"

# the linter first: it takes a second, the suite minutes
test: setup
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q tests

demo: setup
	$(PYTHON) -m longstraw_cli train
