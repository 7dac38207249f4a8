# kvoffload-spec: every target creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint typecheck diagrams check-diagrams clean

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

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -q -p no:cacheprovider --cov=statemachine --cov=spec --cov-report=term:skip-covered
	$(BIN)/kvspec diagrams --check

diagrams: $(STAMP)
	$(BIN)/kvspec diagrams

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
