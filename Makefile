# kvoffload-spec: every target creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test coverage campaign soak check check-groups mutate diagrams conformance bench-scheduler clean

venv: $(STAMP)

# torch is installed first and pinned, so that a CPU-only machine takes the CPU build and never
# downloads a multi-GB CUDA build; everything else follows.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

DEMO_LOG ?= $(or $(TMPDIR),/tmp)/kvspec-demo-monitor.jsonl
demo: $(STAMP)
	$(BIN)/kvspec demo
	$(BIN)/kvspec simulate --seed 1
	$(BIN)/kvspec simulate --tiers cpu,fs --seed 1
	$(BIN)/kvspec simulate --seed 2 --monitor-log $(DEMO_LOG) --no-progress
	$(BIN)/kvspec replay $(DEMO_LOG)
	$(BIN)/kvspec check
	$(BIN)/kvspec check --tiering

# the tests run one file per worker over every core (a module's fixtures are built once); the
# exhaustive searches in a run of their own, test by test (a few long searches dominate);
# line coverage is `make coverage` (the tracer costs `make test` about 2.5 minutes)
UNIT := -m "not campaign and not conformance and not soak and not exhaustive and not deep"
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -q -p no:cacheprovider $(UNIT) -n auto --dist loadfile --durations=10
	$(BIN)/pytest -q -p no:cacheprovider -m "exhaustive and not deep" -n auto --dist worksteal --durations=10
	$(BIN)/kvspec diagrams --check

# the tests of `make test` but the exhaustive searches, with line coverage of spec/ and
# statemachine/
coverage: $(STAMP)
	$(BIN)/pytest -q -p no:cacheprovider $(UNIT) -n auto --dist loadfile --cov=statemachine --cov=spec --cov-report=term:skip-covered

# the long random campaign: seeds in parallel (KVSPEC_CAMPAIGN_SEEDS, _EXAMPLES to size it)
campaign: $(STAMP)
	$(BIN)/pytest -q -p no:cacheprovider -m campaign -n auto -s tests/test_campaign.py

# the soak: STEPS model steps of the model-based machine (and STEPS/5 of the data-plane one),
# seeds split over every core; SEED picks the first seed, MUTANT switches a fault on
STEPS ?= 1000000
SEED ?= 0
MUTANT ?=
soak: $(STAMP)
	KVSPEC_SOAK_STEPS=$(STEPS) KVSPEC_SOAK_SEED=$(SEED) KVSPEC_SOAK_MUTANT=$(MUTANT) \
		$(BIN)/pytest -q -p no:cacheprovider -m soak -n auto -rN tests/test_soak.py

check: $(STAMP)
	$(BIN)/kvspec check
	$(BIN)/kvspec check --tiering

# exhaustive checks of several KV cache groups past the pinned scenarios (tests/test_deep_groups.py:
# Mamba groups and partial tails on the Python model, full-attention and window groups on the
# compiled twin), the pinned outcome of the longest scenario, three-requests (tests/test_checker.py),
# the two models' larger whole-space comparisons (tests/test_checker_compiled.py),
# the threaded search under ThreadSanitizer (tests/test_checker_threads.py), and that each row
# witness runs under the first scenario that fires its row (tests/test_witnesses.py)
check-groups: $(STAMP)
	$(BIN)/pytest -q -p no:cacheprovider -m deep -n auto --dist worksteal --durations=20 tests/test_deep_groups.py tests/test_checker.py tests/test_checker_compiled.py tests/test_checker_threads.py tests/test_witnesses.py

# the spec's own mutants: every row's effects dropped, every guard negated (spec/equivalents.py);
# the listed survivors proven at this fingerprint (spec/equivalents.proof.json) are not searched
# again: after a change to spec/ or the checkers everything is, and the proof is rewritten
mutate: $(STAMP)
	$(BIN)/kvspec check --mutate

diagrams: $(STAMP)
	$(BIN)/kvspec diagrams

# Conformance: the model-based tests against vLLM's own scheduler side (CONFORMANCE.md).
# VLLM_VERSION picks the release (its own venv: .venv-vllm for 0.33.0, .venv-vllm-X else);
# it must be one conformance/releases.py lists (checked before any venv is built).
# VLLM_SRC=path tests a vLLM source tree (a pull request's checkout) instead: its Python tree
# goes ahead of the installed wheel on the path (the scheduler side is pure Python).
# Reproducible: hypothesis derandomized, no example database (tests/conformance/conftest.py),
# PYTHONHASHSEED fixed (HASHSEED); the report header prints them.
VLLM_VERSION ?= 0.33.0
VLLM_SRC ?=
HASHSEED ?= 0
VLLM_VENV := .venv-vllm$(if $(filter 0.33.0,$(VLLM_VERSION)),,-$(VLLM_VERSION))
VLLM_STAMP := $(VLLM_VENV)/.vllm-version
# the environment of a run against vLLM: the release, the hash seed, a source tree ahead of the wheel
VLLM_ENV = KVSPEC_VLLM_VERSION=$(VLLM_VERSION) PYTHONHASHSEED=$(HASHSEED) $(if $(VLLM_SRC),VLLM_SRC=$(abspath $(VLLM_SRC)) PYTHONPATH=$(abspath $(VLLM_SRC)),)

.PHONY: check-vllm-version conformance-all conformance-soak
check-vllm-version:
	@$(PY) conformance/releases.py check $(VLLM_VERSION)

# a venv already holding the release is updated in place when the script or the extras change
$(VLLM_STAMP): scripts/vllm-venv.sh conformance/releases.py | check-vllm-version
	PY=$(PY) scripts/vllm-venv.sh $(VLLM_VENV) $(VLLM_VERSION)

conformance: check-vllm-version $(VLLM_STAMP)
	$(VLLM_ENV) $(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider --hypothesis-profile=kvspec-conformance -rfEsP -m conformance tests/conformance

# A long seeded campaign against vLLM (tests/conformance/test_soak_vllm.py): VLLM_STEPS model
# steps per machine (the release's conformance machine and, from 0.26, the hybrid one), over
# SOAK_SEEDS seeds from SEED, split over every core; each failure shrunk, printed with the
# command that reruns its seed. VLLM_VERSION and VLLM_SRC as for `make conformance`.
VLLM_STEPS ?= 200000
SOAK_SEEDS ?= 2
conformance-soak: check-vllm-version $(VLLM_STAMP)
	$(VLLM_ENV) KVSPEC_SOAK_STEPS=$(VLLM_STEPS) KVSPEC_SOAK_SEEDS=$(SOAK_SEEDS) KVSPEC_SOAK_SEED=$(SEED) \
		$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider -m soak -n auto -rN tests/conformance/test_soak_vllm.py

# The matrix: every supported release (RELEASES="0.22.0 0.33.0" for some), one at a time:
# build, run, verdict and times; each venv this built removed after its run unless KEEP=1.
# The table goes to stdout and to $(CONFORMANCE_OUT)/summary.md (outside the repository).
# SOAK=N also soaks each release (make conformance-soak VLLM_STEPS=N SEED=$(SEED)): a
# column of its own.
RELEASES ?=
KEEP ?= 0
CONFORMANCE_OUT ?= /tmp/kvspec-conformance
SOAK ?= 0
conformance-all:
	PY=$(PY) KEEP=$(KEEP) OUT=$(CONFORMANCE_OUT) SOAK_STEPS=$(SOAK) SOAK_SEED=$(SEED) \
		scripts/conformance-all.sh $(RELEASES)

# Our scheduler against vLLM's, the same trace, CPU time per step (bench/scheduler.py)
bench-scheduler: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python bench/scheduler.py

clean:
	rm -rf $(VENV) .venv-vllm* .pytest_cache .mypy_cache .ruff_cache .hypothesis
