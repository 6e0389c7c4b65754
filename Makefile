# Two commands do all the set-up on a fresh machine:
#   make demo   plan, verify and export the built-in example model end to end
#   make test   run the test suite
# Each creates .venv and installs what it needs. torch==2.13.0 is installed first where torch is
# missing: it is a CPU build on this machine's disk, while a bare `torch` pulls GBs of CUDA.
# `make demo` installs surgery and its run-time dependencies only; the test and lint tools
# (pytest, ruff, mypy, build) come with the targets that use them.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.surgery-installed
DEV    := $(VENV)/.surgery-dev-installed
TORCH  ?= torch==2.13.0
# torch as installed in the venv, as a constraint for every later pip call (see constraints.txt).
PIN    := $(VENV)/torch-pin.txt
DEMO   := .demo

.PHONY: install test test-fast lint demo golden manifests wheel bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || { \
		echo "== installing $(TORCH) (the long step, about a minute)"; \
		$(BIN)/pip install --progress-bar on "$(TORCH)"; }
	@$(BIN)/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(PIN)
	@echo "== installing surgery and its run-time dependencies ($$(cat $(PIN)) kept)"
	$(BIN)/pip install --progress-bar on -c constraints.txt -c $(PIN) -e .
	touch $@

$(DEV): $(STAMP) constraints.txt
	@echo "== installing the test and lint tools (pytest, ruff, mypy, build) and the zoo's timm, transformers, diffusers"
	$(BIN)/pip install --progress-bar on -c constraints.txt -c $(PIN) -e ".[dev]"
	touch $@

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
