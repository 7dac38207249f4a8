# kvoffload-spec: every target creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test campaign check diagrams clean

venv: $(STAMP)

# torch is installed first and pinned, so that a CPU-only machine takes the CPU build and never
# downloads a multi-GB CUDA build; everything else follows.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	@command -v dot >/dev/null || echo "warning: graphviz 'dot' not found: apt-get install -y graphviz"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvspec demo
	$(BIN)/kvspec simulate --seed 1
	$(BIN)/kvspec check

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -q -p no:cacheprovider -m "not campaign" --cov=statemachine --cov=spec --cov-report=term:skip-covered
	$(BIN)/kvspec diagrams --check

# the long random campaign: seeds in parallel (KVSPEC_CAMPAIGN_SEEDS, _EXAMPLES to size it)
campaign: $(STAMP)
	$(BIN)/pytest -q -p no:cacheprovider -m campaign -n auto -s tests/test_campaign.py

check: $(STAMP)
	$(BIN)/kvspec check

diagrams: $(STAMP)
	$(BIN)/kvspec diagrams

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
