# shift-lightning: the README's commands. Each target sets up .venv first (once; again when
# pyproject.toml changes): a virtual environment with the CPU torch wheel and this package.
#
#   make run        the main job on the embedded default (SmolLM2-135M, 25% Reverse-order* + LRAs)
#   make test       the product's tests
#   make test-experiments   the research grids' own tests (experiments/tests)
#   make reproduce  the paper's tables for MODEL (resumable; many CPU-hours)
#   make ablations  the paper's ablations for MODEL (resumable)
#   make tables     re-render every committed table in results/ from its JSON
#
# GPU machines: put the CUDA build of torch in first, e.g.
#   make run TORCH_INDEX=https://download.pytorch.org/whl/cu126
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
MODEL ?= smollm2-135m
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shift-lightning-installed

.PHONY: setup run test test-experiments reproduce ablations tables

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "error: Python >= 3.10 is needed (found " + sys.version.split()[0] + "); run make PYTHON=python3.11 ...")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || { echo "error: could not create $(VENV); on Debian/Ubuntu: apt-get install python3-venv"; exit 2; }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	PYTHONWARNINGS=ignore $(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

run: $(STAMP)  ## main job: 25% Reverse-order* pruning of SmolLM2-135M + closed-form LRAs, evaluated
	$(PY) calibrate.py --config configs/smollm2_reverse_star.yaml --output_dir outputs/smollm2_rs --overwrite

test: $(STAMP)  ## the product's tests (tiny random models, 2-process DDP over gloo), in 2 pytest workers
	$(PY) -m pytest -q -n 2

test-experiments: $(STAMP)  ## the research grids' and checks' own tests (experiments/tests)
	$(PY) -m pytest -q -n 2 experiments/tests

reproduce: $(STAMP)  ## the paper's tables for MODEL (resumable; many CPU-hours, ~10 GPU-minutes)
	$(PY) -m experiments.reproduce --model $(MODEL)

ablations: $(STAMP)  ## the paper's ablations on MODEL (resumable; reuses the grid's block choices)
	$(PY) -m experiments.ablations --model $(MODEL)

tables: $(STAMP)  ## re-render every committed table in results/ from its JSON (no model is run)
	$(PY) -m experiments.render
