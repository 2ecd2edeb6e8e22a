# Two commands from a fresh clone: `make demo` (the main job) and `make test` (the suite);
# `make lint` (ruff, then mypy; configured in pyproject.toml) is what CI runs before the suite,
# and `make docs` builds the documentation site into site/.
# Each creates .venv on first use; nothing else needs to be installed by hand.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint docs bench clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "funcgrad needs Python >= 3.11; run make PYTHON=python3.11 ...")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/funcgrad train --out runs/demo --overwrite

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy funcgrad

# mkdocs.yml: the pages under docs/, the API reference from the docstrings. --strict makes a
# broken link or cross-reference an error. NO_MKDOCS_2_WARNING=1 hides Material's notice
# about MkDocs 2 (printed on every build; it is not about this site).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python benchmarks/train_step.py
	$(BIN)/python benchmarks/taps.py
	$(BIN)/python benchmarks/accumulate.py
	$(BIN)/python benchmarks/gradcheck.py
	$(BIN)/python benchmarks/gradcheck_ops.py
	$(BIN)/python benchmarks/monitor.py
	$(BIN)/python benchmarks/interop.py
	$(BIN)/python benchmarks/memory_report.py
	$(BIN)/python benchmarks/remat.py
	$(BIN)/python benchmarks/fit.py
	$(BIN)/python benchmarks/train_cli.py
	$(BIN)/python benchmarks/micro.py
	$(BIN)/python benchmarks/parallel.py

clean:
	rm -rf $(VENV) runs site .pytest_cache .hypothesis .mypy_cache .ruff_cache
