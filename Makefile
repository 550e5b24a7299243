# The two commands a new user needs (see README):
#   make demo   -> installs pdproxy (+ the openai client) into .venv, then runs the proxy on :8000 in front of
#                  1 simulated prefiller + 2 decoders
#   make test   -> installs pdproxy + the test tools into .venv, then runs the whole test suite
# Each target installs only its own extra (pyproject.toml); an extra is installed once (stamp files in .venv/).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test install fast-test real-vllm-test bench bench-pinned prefix-bench fuzz attack-bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-%: pyproject.toml setup.py $(wildcard pdproxy/*/*.c) | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[$*]'
	touch $@

install: $(VENV)/.installed-test $(VENV)/.installed-bench

demo: $(VENV)/.installed-demo
	$(BIN)/pdproxy demo

fast-test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -m "not real_vllm" -q

test: $(VENV)/.installed-test
	bash scripts/test-all.sh

# pdproxy vs vllm-router as users run them (nothing pinned, whole-run CPU): prints ratios (loadtest/users_bench.py)
bench: $(VENV)/.installed-bench
	$(BIN)/python -m loadtest.users_bench --out loadtest/results/users-latest.json

# the pinned, windowed figures and plots of loadtest/RESULTS.md (latency scenarios, admission; loadtest/bench.py)
bench-pinned: $(VENV)/.installed-bench
	$(BIN)/python -m loadtest.bench --out loadtest/results/latest.json
	$(BIN)/python -m loadtest.plots loadtest/results/latest.json --out loadtest/results

prefix-bench: $(VENV)/.installed-bench
	$(BIN)/python -m loadtest.prefix_bench --json loadtest/results/prefix.json

# the HTTP server fuzzer, long (tests/security/test_server_fuzz.py; `make test` runs 200 inputs): FUZZ_EXAMPLES=N
FUZZ_EXAMPLES ?= 20000
fuzz: $(VENV)/.installed-test
	PDPROXY_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q -p no:randomly --timeout 0 \
		--hypothesis-show-statistics tests/security/test_server_fuzz.py

# a mixed attack on pdproxy (slow heads, endless header lines, deep JSON, ReDoS multipart) while a client streams
attack-bench: $(VENV)/.installed-bench
	$(BIN)/python -m loadtest.attack_bench

clean:
	rm -rf $(VENV)
