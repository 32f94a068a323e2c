# Two commands on a fresh machine: `make run` (set up, train the default experiment)
# and `make test` (set up, run the test suite; `make test-fast`: the tier without processes). Both create .venv when it is missing.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.trainlab-installed

# Without a GPU, take the CPU build of torch (a few hundred MB) instead of the default
# CUDA build (several GB). Elsewhere set PIP_EXTRA_INDEX_URL to a CPU wheel index, or
# override TORCH_SPEC.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAS_GPU),yes)
TORCH_SPEC ?= torch==2.13.0
EXTRAS := dev,gpu
else
EXTRAS := dev
TORCH_SPEC ?= torch==2.13.0+cpu
endif

.PHONY: setup run test test-fast clean

setup: $(STAMP)

# pip's notes about local index folders it skips are noise; real errors still fail the build.
QUIET := 2>&1 | { grep -v -e 'is ignored: it is neither a file nor a directory' -e 'BuildBackendWarning' || true; }

$(STAMP): pyproject.toml
	@echo "setting up $(VENV) ($(TORCH_SPEC)); this takes a minute or two the first time"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@PYTHONWARNINGS=ignore $(PY) -m pip install -q --upgrade pip setuptools wheel $(QUIET)
	@PYTHONWARNINGS=ignore $(PY) -m pip install -q "$(TORCH_SPEC)" $(QUIET)
	@PYTHONWARNINGS=ignore $(PY) -m pip install -q -e ".[$(EXTRAS)]" $(QUIET)
	@# DeepSpeed ships as an sdist whose setup.py imports torch: build it against the torch above.
	@DS_BUILD_OPS=0 PYTHONWARNINGS=ignore $(PY) -m pip install -q --no-build-isolation -e ".[deepspeed]" $(QUIET)
	@touch $(STAMP)
	@echo "setup done"

run: setup
	$(PY) -m framework.train $(ARGS)

# The whole suite in two tiers: the fast tier on pytest-xdist workers as in test-fast (its tests are independent
# single-process ones), then the slow tier (drivers, ranks, sweeps) in one process: its runs size their thread pools
# to the machine's cores (ranks x threads <= cores), so two at once would oversubscribe them. PYTEST_ARGS go to
# both tiers (so not -m or -n: run pytest itself for those). Failed tests in the first tier (exit 1) do not stop the
# second; an interrupt (Ctrl-C: 2), an error of pytest's (3, 4) does. A tier they leave empty (5) is no failure; both empty is.
test: setup
	@rc=0; empty=0; \
	$(PY) -m pytest -q -m "not slow" -n auto --maxprocesses 4 $(PYTEST_ARGS) \
		|| { r=$$?; case $$r in 1) rc=1 ;; 5) empty=$$((empty + 1)) ;; *) exit $$r ;; esac; }; \
	$(PY) -m pytest -q -m slow --durations=30 $(PYTEST_ARGS) \
		|| { r=$$?; case $$r in 1) rc=1 ;; 5) empty=$$((empty + 1)) ;; *) exit $$r ;; esac; }; \
	if [ $$empty = 2 ]; then rc=5; fi; exit $$rc

# The development tier: tests that start no process (no driver, ranks or rendezvous); docs/tests.md.
# They are independent single-process tests: pytest-xdist runs them on one worker per core (at most
# 4), each worker with cores // workers torch threads (tests/conftest.py).
test-fast: setup
	$(PY) -m pytest -q -m "not slow" -n auto --maxprocesses 4 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) outputs multirun checkpoints mlruns.db mlruns .cache
