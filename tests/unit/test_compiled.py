"""pdproxy.compiled: which optional compiled parts are in use (setup.py's five C files)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdproxy.compiled import NO_EXTENSIONS_ENV, compiled_module, compiled_or

ROOT = Path(__file__).resolve().parents[2]
PARTS = {"pdproxy.pd._record": "pdproxy.pd.record:RecordBase", "pdproxy.pd._splice": "pdproxy.pd.splice:SpliceBase",
         "pdproxy.http._chunked": "pdproxy.http.server:_chunk_writer",
         "pdproxy.apis._jsonscan": "pdproxy.apis.request:NESTS_WITHIN",
         "pdproxy.prefix._textkeys": "pdproxy.prefix.index:CHUNK_KEYS"}


def test_a_module_not_built_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NO_EXTENSIONS_ENV, raising=False)
    assert compiled_module("pdproxy.pd._no_such_part") is None
    assert compiled_module("pdproxy.pd._splice") is not None, "pdproxy/pd/_splice.c was not built: run make install"


def test_the_pick_is_the_compiled_attribute_or_the_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdproxy.pd import _splice, splice
    monkeypatch.delenv(NO_EXTENSIONS_ENV, raising=False)
    assert compiled_or("pdproxy.pd._splice", "SpliceBase", splice.PySpliceBase) is _splice.SpliceBase
    assert compiled_or("pdproxy.pd._no_such_part", "SpliceBase", splice.PySpliceBase) is splice.PySpliceBase
    monkeypatch.setenv(NO_EXTENSIONS_ENV, "1")
    assert compiled_or("pdproxy.pd._splice", "SpliceBase", splice.PySpliceBase) is splice.PySpliceBase


@pytest.mark.timeout(60)
@pytest.mark.parametrize("disabled", [False, True], ids=["built", "PDPROXY_NO_EXTENSIONS"])
def test_every_part_is_the_compiled_one_unless_disabled(disabled: bool) -> None:
    """In a fresh interpreter (the choice is made at import): each module's pick comes from its C file, or — with
    ``PDPROXY_NO_EXTENSIONS=1`` — from none of them."""
    code = ("import importlib, sys\n"
            f"parts = {PARTS!r}\n"
            "for ext, where in parts.items():\n"
            "    mod, attr = where.split(':')\n"
            "    picked = getattr(importlib.import_module(mod), attr)\n"
            "    print(ext, getattr(picked, '__module__', None) == ext)\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    if disabled:
        env[NO_EXTENSIONS_ENV] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    got = dict(line.split() for line in out.stdout.splitlines())
    assert got == {ext: str(not disabled) for ext in PARTS}
