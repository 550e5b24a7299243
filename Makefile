# The two commands a new user needs (see README):
#   make demo   -> installs into .venv, then runs the proxy on :8000 in front of 1 simulated prefiller + 2 decoders
#   make test   -> installs into .venv, then runs the whole test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install fast-test real-vllm-test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,loadtest]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/pdproxy demo

fast-test: $(STAMP)
	$(BIN)/python -m pytest -m "not real_vllm" -q

test: $(STAMP)
	bash scripts/test-all.sh

bench: $(STAMP)
	$(BIN)/python -m loadtest.bench

clean:
	rm -rf $(VENV)
