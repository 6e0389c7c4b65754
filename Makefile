# Two commands do all the set-up on a fresh machine:
#   make demo   plan, verify and export the built-in example model end to end
#   make test   run the test suite
# Each creates .venv and installs what it needs. torch==2.13.0 is installed first where torch is
# missing: it is a CPU build on this machine's disk, while a bare `torch` pulls GBs of CUDA.
# `make demo` installs surgery and its run-time dependencies only; the test and lint tools
# (pytest, ruff, mypy, build) and the zoo's timm, transformers, diffusers come with the targets
# that use them.
#
# timm imports torchvision, and each torchvision release works with exactly one torch release.
# PyPI's x86_64 torchvision is built against CUDA torch, so beside the CPU torch 2.13.0 it does
# not import ("operator torchvision::nms does not exist"), and neither does timm nor, after it,
# transformers' BertModel. So where torchvision does not import, the dev install puts in a
# matching pair first (VISION: by `uname -m`, pairs that pip finds on this project's machines),
# and the torch pin follows it. A venv whose torchvision already imports is left as it is.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.surgery-installed
DEV    := $(VENV)/.surgery-dev-installed
TORCH  ?= torch==2.13.0
ifeq ($(shell uname -m),aarch64)
VISION ?= torch==2.9.1 torchvision==0.24.1
else
VISION ?= torch==2.14.1 torchvision==0.29.1
endif
# What the dev install must leave importable (checked after it, and by .ci/run).
ZOO_IMPORTS := import timm, transformers, diffusers; from transformers import BertModel
# torch as installed in the venv, as a constraint for every later pip call (see constraints.txt).
PIN    := $(VENV)/torch-pin.txt
DEMO   := .demo

.PHONY: install test test-fast lint demo golden manifests wheel bench clean pin check-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || { \
		echo "== installing $(TORCH) (the long step, about a minute)"; \
		$(BIN)/pip install --progress-bar on "$(TORCH)"; }
	@$(MAKE) --no-print-directory pin
	@echo "== installing surgery and its run-time dependencies ($$(cat $(PIN)) kept)"
	$(BIN)/pip install --progress-bar on -c constraints.txt -c $(PIN) -e .
	touch $@

# The pin is read from the package metadata, not by importing torch: before numpy is installed,
# `import torch` prints a NumPy warning that would look like a failure.
pin:
	@$(BIN)/python -c "from importlib.metadata import version; print('torch==' + version('torch').split('+')[0])" > $(PIN)

$(DEV): $(STAMP) constraints.txt
	@$(BIN)/python -c "import torchvision" 2>/dev/null || { \
		echo "== installing $(VISION): timm needs a torchvision built for the installed torch (several GB)"; \
		$(BIN)/pip install --progress-bar on -c constraints.txt $(VISION); }
	@$(MAKE) --no-print-directory pin
	@echo "== installing the test and lint tools (pytest, ruff, mypy, build) and the zoo's timm, transformers, diffusers ($$(cat $(PIN)) kept)"
	$(BIN)/pip install --progress-bar on -c constraints.txt -c $(PIN) -e ".[dev]"
	@$(BIN)/python -c "$(ZOO_IMPORTS)" || { \
		echo "error: the zoo packages do not import in $(VENV) (see above); fix: make clean && make install"; exit 1; }
	touch $@

# The check .ci/run makes on a fresh clone: the model packages import outside pytest.
check-venv: $(DEV)
	$(BIN)/python -c "$(ZOO_IMPORTS); print('zoo imports: ok')"

install: $(DEV)

test: $(DEV)
	$(BIN)/python -m pytest -q

test-fast: $(DEV)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(DEV)
	$(BIN)/ruff check surgery tests benchmarks
	$(BIN)/mypy

# The main job on the built-in example model: a checkpoint as a hand-written regional compile
# saves it (with _orig_mod. keys), then plan -> verify (finds them) -> export -> verify (clean).
demo: $(STAMP)
	rm -rf $(DEMO) && mkdir -p $(DEMO)
	$(BIN)/python -m surgery.examples $(DEMO)/example.pt
	$(BIN)/surgery plan $(DEMO)/example.pt -o $(DEMO)/example.surgery.toml
	$(BIN)/surgery plan --model surgery.examples:tiny -o $(DEMO)/live.surgery.toml
	$(BIN)/surgery check $(DEMO)/live.surgery.toml
	-$(BIN)/surgery verify $(DEMO)/example.pt; echo "verify exit code: $$? (1 = findings, expected)"
	$(BIN)/surgery export $(DEMO)/example.pt -o $(DEMO)/example.safetensors \
		--manifest $(DEMO)/example.surgery.toml
	$(BIN)/surgery verify $(DEMO)/example.safetensors --manifest $(DEMO)/example.surgery.toml
	$(BIN)/python -m surgery.examples.demo $(DEMO)/example.safetensors
	@echo "demo done: see $(DEMO)/"

# Golden manifests of the tiny example model, reviewed as diffs.
golden: $(STAMP)
	$(BIN)/python tests/make_golden.py

# Example manifests shipped in manifests/ (validated by the tests).
manifests: $(STAMP)
	$(BIN)/surgery plan --model surgery.examples:tiny -o manifests/example-tiny.surgery.toml --force
	$(BIN)/surgery plan --model surgery.examples:lingbot -o manifests/example-lingbot.surgery.toml --force
	$(BIN)/surgery plan --model surgery.examples:lingbot --backend cudagraphs \
		-o manifests/example-lingbot-cudagraphs.surgery.toml --force

wheel: $(DEV)
	$(BIN)/python -m build --wheel --outdir dist .

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_plan.py
	$(BIN)/python benchmarks/bench_replay_overhead.py

clean:
	rm -rf $(VENV) $(DEMO) dist build *.egg-info .pytest_cache .ruff_cache .mypy_cache
