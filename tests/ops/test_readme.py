"""The README and the docs as a new user reads them: nothing points outside the repository, every path and picture
they name exists, every shell command is runnable as printed from the repository (the programs live in
``.venv/bin``; the flags it uses exist), and every timeout a user can hit is in the settings table."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from pdproxy.settings import Settings

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "deploy").glob("*/README.md")),
        ROOT / "loadtest" / "RESULTS.md"]
TOP = ("pdproxy/", "tests/", "docs/", "deploy/", "loadtest/", "config/", "scripts/", "docker/", ".ci/")
# What a README command may start with: the project's own tools (make targets, scripts) or programs every
# reader has (curl, docker, kubectl); pdproxy, python and locust only from .venv/bin.
ALLOWED = {"make", "curl", "docker", "kubectl", "bash", "cd", "export"}


def bash_commands(text: str) -> list[str]:
    """The commands of every ```bash block (continuation lines joined, comments and heredoc bodies dropped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            heredoc = re.search(r"<<'?(\w+)'?", line)
            if heredoc:  # skip the document up to its terminator
                while i < len(lines) and lines[i].strip() != heredoc.group(1):
                    i += 1
                i += 1
            command = line.split(" #", 1)[0].strip().rstrip("&").strip()
            if command and not command.startswith("#"):
                out.append(command)
    return out


def program(command: str) -> str:
    words = [w for w in shlex.split(command, posix=True) if not re.match(r"^[A-Z_]+=", w)]
    return words[0] if words else ""


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_points_outside_the_repository(doc: Path) -> None:
    text = doc.read_text()
    assert "../" not in text and "shared/seeds" not in text and "shared/reference" not in text
    for path in re.findall(r"`([^`\s]+)`", text) + re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        path = path.split(":")[0].split("#")[0].rstrip(".,")
        if path.startswith(TOP) and re.search(r"\.\w+$", path) and "*" not in path and "<" not in path:
            base = doc.parent if not (ROOT / path).exists() and (doc.parent / path).exists() else ROOT
            assert (base / path).exists(), f"{doc.name} names {path}, which is not in the repository"
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (doc.parent / image).is_file(), f"{doc.name}: picture {image} is missing"


def test_readme_shows_a_picture_and_how_to_import_the_dashboard() -> None:
    text = README.read_text()
    assert re.search(r"!\[[^\]]+\]\(loadtest/results/\w+\.png\)", text)
    assert "deploy/grafana/pdproxy.json" in text and "Import" in text


def test_every_command_runs_as_printed() -> None:
    commands = [c for doc in DOCS for c in bash_commands(doc.read_text())]
    assert len(commands) >= 8
    for command in commands:
        prog = program(command)
        assert prog in ALLOWED or prog.startswith(".venv/bin/") or prog.startswith("scripts/"), (
            f"not runnable as printed on a fresh machine (use .venv/bin/…): {command}")
    text = README.read_text()
    for code in re.findall(r"`([^`]+)`", text):  # inline commands too
        assert not re.match(r"(pdproxy (serve|sim|demo|doctor)|python3? -m|locust|pip) ", code), (
            f"inline command not runnable as printed (use .venv/bin/…): {code}")
    # the flags each pdproxy / python -m command uses exist (help texts of the real programs)
    helps: dict[tuple[str, ...], str] = {}
    for command in commands:
        words = shlex.split(command)
        if words[0] == ".venv/bin/pdproxy":
            key = (str(ROOT / words[0]), words[1])
        elif words[0] == ".venv/bin/python" and words[1:2] == ["-m"]:
            key = (str(ROOT / words[0]), "-m", words[2])
        else:
            continue
        if key not in helps:
            done = subprocess.run([*key, "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
            assert done.returncode == 0, (command, done.stderr[-500:])
            helps[key] = done.stdout
        for flag in (w.split("=")[0] for w in words if w.startswith("--")):
            assert flag in helps[key], f"{command}: {flag} is not a flag of {' '.join(key[-2:])}"


def test_every_timeout_is_in_the_readme_settings_table() -> None:
    text = README.read_text() + (ROOT / "docs" / "limits.md").read_text()  # the client edge's limits live there
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| (`[^|]+`(?:[^|]*)) \|.*$", text, re.M)}
    table = "\n".join(rows.values())
    timeouts = [n for n in Settings.model_fields if n.endswith("_timeout_s") or n.startswith(("shutdown_",
                                                                                             "prefill_timeout_"))]
    assert "decode_nonstream_timeout_s" in timeouts and len(timeouts) >= 10
    for name in timeouts:
        row = next((r for r in rows.values() if f"`{name}`" in r), None)
        assert row is not None, f"{name} is not in README's settings tables"
        default = Settings.model_fields[name].default
        if default is not None:
            assert f"{default:g}" in row, f"{name}: default {default:g} not in its row: {row}"
    assert "600" in table


@pytest.mark.parametrize(("target", "extra"), [("demo", "demo"), ("test", "test"), ("bench", "bench")])
def test_each_make_target_installs_only_its_extra(target: str, extra: str) -> None:
    done = subprocess.run(["make", "-n", "-B", target], capture_output=True, text=True, timeout=30, cwd=ROOT,
                          check=True)
    installs = re.findall(r"pip install -q -e '\.\[([\w,]+)\]'", done.stdout)
    assert installs == [extra], done.stdout
    if target == "bench":  # the users' benchmark (pdproxy vs vllm-router, ratios); the pinned one: JSON, then plots
        assert "loadtest.users_bench" in done.stdout
        pinned = subprocess.run(["make", "-n", "-B", "bench-pinned"], capture_output=True, text=True, timeout=30,
                                cwd=ROOT, check=True).stdout
        assert pinned.index("loadtest.bench") < pinned.index("loadtest.plots")


def test_the_docs_index_lists_every_page() -> None:
    """docs/index.md says "one line per page": every page of docs/ is there (a new operator found half missing)."""
    index = (ROOT / "docs" / "index.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "index.md")
    assert [p for p in pages if f"`docs/{p}`" not in index] == []
