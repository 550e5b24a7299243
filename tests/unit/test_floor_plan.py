"""The package's floor plan (docs/architecture.md, "The import levels"): every import — top-level, function-level and under
``TYPE_CHECKING`` alike — runs from a folder (or top-level module) to one on a lower level; loops stay inside one
folder.  A new folder or top-level module must be given a level here, which is the point: it is a decision."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pdproxy"

LEVELS: list[tuple[str, ...]] = [          # bottom up: each unit may import only units on lower levels
    ("endpoints", "compiled"),             # vocabulary: what an engine address is; which C parts are in use
    ("errors", "tokens", "timeline"),      # vocabulary: the error tree, token ids, a request's marks
    ("settings",),                         # vocabulary: every setting, validated
    ("http",),                             # bytes on sockets
    ("apis", "engines"),                   # the wire shapes and the P→D contract; what pdproxy knows of engines
    ("scheduling", "ops", "tools"),        # which endpoint; metrics/logs/tracing; doctor and demo
    ("admission", "workers"),              # whether a request fits; what --workers N share
    ("prefix",),                           # prefix-cache knowledge
    ("pd", "sim"),                         # the P→D request path; the engine simulator
    ("app",),                              # the process
    ("cli",),
    ("__main__",),
]
LEVEL = {unit: i for i, units in enumerate(LEVELS) for unit in units}


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("pdproxy", *path.relative_to(PACKAGE).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def unit(module: str) -> str:
    """The floor-plan unit of a module: its folder under pdproxy/, or the top-level module itself."""
    return module.split(".")[1]


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The pdproxy modules ``module`` imports anywhere in its text (resolved to the longest known module)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != "pdproxy":
                found.add(name)
    return found


def test_every_import_runs_downward() -> None:
    known = modules()
    upward = []
    for module, path in sorted(known.items()):
        if module == "pdproxy":
            continue
        assert unit(module) in LEVEL, f"{module}: give its folder a level in LEVELS (tests/unit/test_floor_plan.py)"
        for target in imports(module, path, known):
            if unit(target) != unit(module) and LEVEL[unit(target)] >= LEVEL[unit(module)]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that do not run downward:\n" + "\n".join(upward)


def test_the_checker_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    """The parser itself, on a module that hides its imports: both must be found."""
    (tmp_path / "m.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from pdproxy.app import state\n"
                                   "def f():\n    import pdproxy.cli\n    from . import sibling\n")
    known = {"pdproxy.app.state": Path(), "pdproxy.cli": Path(), "pdproxy.http.sibling": Path()}
    assert imports("pdproxy.http.m", tmp_path / "m.py", known) == {"pdproxy.app.state", "pdproxy.cli",
                                                                   "pdproxy.http.sibling"}
