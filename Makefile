# vlmc developer entry points. Everything installs into a local venv (.venv) from pinned versions.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.vlmc-installed
PIP    := $(BIN)/pip install -q --disable-pip-version-check -c constraints.txt
DEMO   := out/demo
JOBS   ?= 2

.PHONY: install demo test lint bench matrix schema clean

install: $(STAMP)

# torch is installed first and pinned: the 2.13.0 CPU wheel is what a plain `torch` must not replace.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[export,serve,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/vlmc build --recipe recipes/demo.yaml -o $(DEMO) --force
	$(BIN)/vlmc run $(DEMO)/package --image demo --prompt "Describe the image." --max-new-tokens 8
	$(BIN)/vlmc verify $(DEMO)/package --max-new-tokens 20
	$(BIN)/vlmc inspect $(DEMO)/package

test: $(STAMP)
	$(BIN)/ruff check vlmc passes tests scripts
	$(BIN)/ruff format --check vlmc passes tests scripts
	$(BIN)/python -m pytest -n $(JOBS) --dist loadgroup

lint: $(STAMP)
	$(BIN)/ruff check vlmc passes tests scripts
	$(BIN)/ruff format --check vlmc passes tests scripts

bench: $(STAMP)
	$(BIN)/python scripts/bench.py --out docs/benchmarks.md --large-runs 3 $(if $(BENCH_7B),--7b) $(if $(BENCH_7B_DIR),--7b-dir $(BENCH_7B_DIR)) $(if $(BENCH_PEERS),--peers) $(BENCH_ARGS)

# Every built-in family x recipe x executor (scripts/matrix.py): writes docs/compatibility.md and .json.
matrix: $(STAMP)
	nice -n 10 $(BIN)/python scripts/matrix.py --jobs $(JOBS) --out docs/compatibility.md

schema: $(STAMP)
	$(BIN)/vlmc passes --schema > docs/recipe.schema.json
	$(BIN)/vlmc schema manifest > docs/manifest.schema.json
	$(BIN)/vlmc schema compile > docs/compile.schema.json

clean:
	rm -rf out .pytest_cache build *.egg-info
