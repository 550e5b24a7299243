"""Linting Prometheus exposition text: ``promtool check metrics`` when it is installed (the Debian ``prometheus``
package ships it; scripts/install-promtool.sh installs it), else :func:`lint`, the same naming rules checked with
prometheus-client's parser."""

from __future__ import annotations

import re
import shutil
import subprocess

from prometheus_client.parser import text_string_to_metric_families

NAME = re.compile(r"^[a-z_:][a-z0-9_:]*$")
UNITS = ("seconds", "bytes", "tokens", "total", "perc", "count", "sum", "bucket", "info", "blocks")


def promtool_problems(text: str) -> list[str] | None:
    """What ``promtool check metrics`` reports for ``text`` (empty: clean), or None when promtool is missing."""
    exe = shutil.which("promtool")
    if exe is None:
        return None
    run = subprocess.run([exe, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    problems = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    if run.returncode != 0 and not problems:
        problems = [f"promtool exited {run.returncode}"]
    return problems


def lint(text: str) -> list[str]:
    """promtool's naming rules, by hand: a counter's samples end in ``_total`` (``_created`` aside), no other
    type's do; every family has HELP; names are snake_case; no family is declared twice; histogram buckets carry
    ``le``.  Returns the problems (empty: clean)."""
    problems: list[str] = []
    seen: set[str] = set()
    for fam in text_string_to_metric_families(text):
        if fam.name in seen:
            problems.append(f"{fam.name}: declared twice")
        seen.add(fam.name)
        if not NAME.match(fam.name):
            problems.append(f"{fam.name}: not snake_case")
        if not fam.documentation:
            problems.append(f"{fam.name}: no help text")
        for sample in fam.samples:
            if fam.type == "counter":
                if not sample.name.endswith(("_total", "_created")):
                    problems.append(f"{sample.name}: counter metrics should have \"_total\" suffix")
            elif sample.name.endswith("_total"):
                problems.append(f"{sample.name}: non-counter metrics should not have \"_total\" suffix")
            if sample.name.endswith("_bucket") and fam.type == "histogram" and "le" not in sample.labels:
                problems.append(f"{sample.name}: bucket without le")
    return problems
