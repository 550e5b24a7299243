"""pdproxy's optional compiled parts (``setup.py``): which are in use.

Each C file has a Python twin with the same results (``tests/*/test_*compiled*.py`` and
``tests/continuation/test_record.py`` check them against each other); a module picks its compiled one with
:func:`compiled_module` at import, so an install without a C compiler, or ``PDPROXY_NO_EXTENSIONS`` set (as aiohttp's
``AIOHTTP_NO_EXTENSIONS``), runs the Python ones.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import TypeVar, cast

NO_EXTENSIONS_ENV = "PDPROXY_NO_EXTENSIONS"

T = TypeVar("T")


def compiled_module(name: str) -> ModuleType | None:
    """The compiled module ``name`` (e.g. ``"pdproxy.pd._splice"``) when it is built and ``PDPROXY_NO_EXTENSIONS``
    is unset or empty; None otherwise (not built: no compiler at install time)."""
    if os.environ.get(NO_EXTENSIONS_ENV):
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def compiled_or(name: str, attr: str, twin: T) -> T:
    """``attr`` of the compiled module ``name`` when :func:`compiled_module` finds it, else ``twin``: the Python
    one with the same interface and results, whose type the pick carries (the C parts have no stubs of their own:
    the twins are their typed description)."""
    module = compiled_module(name)
    return twin if module is None else cast(T, getattr(module, attr))
