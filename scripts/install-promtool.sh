#!/usr/bin/env bash
# Install promtool (Prometheus's `promtool check metrics` lints pdproxy's /metrics in tests/ops/test_metrics_lint.py)
# from the Debian/Ubuntu `prometheus` package when it is missing.  Best effort: without apt or root the test falls
# back to the same naming rules checked in Python (tests/ops/metrics_lint.py), and says so.
set -u
if command -v promtool >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 && SUDO="sudo -n" || { echo "promtool: not installed (no root); using the Python lint"; exit 0; }
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "promtool: not installed (no apt-get); using the Python lint"
  exit 0
fi
$SUDO apt-get update -qq >/dev/null 2>&1 || true
if DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1; then
  echo "promtool: installed ($(promtool --version 2>&1 | head -1))"
else
  echo "promtool: the prometheus package could not be installed; using the Python lint"
fi
exit 0
