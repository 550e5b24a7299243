"""The relay's in-process tests run on both event loops: the proxy serves on uvloop (``pdproxy serve``), the
tests' proxies on asyncio."""

from __future__ import annotations

import pytest


@pytest.fixture(params=[pytest.param(("asyncio", {}), id="asyncio"),
                        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    return request.param  # type: ignore[no-any-return]
