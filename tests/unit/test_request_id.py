"""The engine-side request id (pdproxy/timeline.py ``new_request_id``): the client's ``X-Request-Id`` kept as its
prefix when every character is safe, filtered character by character otherwise (ASCII letters, digits, ``-_.:``), cut to 96; 128 random bits."""

from __future__ import annotations

import re

import pytest

from pdproxy.timeline import CLIENT_REQUEST_ID_MAX, new_request_id

pytestmark = pytest.mark.timeout(10)

SUFFIX_16 = re.compile(r"-[0-9a-f]{16}")


@pytest.mark.parametrize(("client", "prefix"), [
    ("cmpl-bench-12345-abc.def:9_x", "cmpl-bench-12345-abc.def:9_x"),   # all safe: kept as sent
    ("a b/c\\d\"e'f", "abcdef"),                                       # space, slashes, quotes: dropped
    ("x\n", "x"),                                                      # a line ending never reaches an engine
    ("caf\u00e9-\u00fcber", "caf-ber"),                                # ASCII only: the id is a header value
    ("z" * 200, "z" * CLIENT_REQUEST_ID_MAX),                          # cut to 96 first
])
def test_the_client_id_is_the_prefix_of_a_unique_engine_id(client: str, prefix: str) -> None:
    ids = {new_request_id(client) for _ in range(100)}
    assert len(ids) == 100
    for rid in ids:
        assert rid.startswith(prefix) and SUFFIX_16.fullmatch(rid[len(prefix):])


@pytest.mark.parametrize("client", [None, "", "/// ???"])
def test_without_a_usable_client_id_the_id_is_32_random_hex_digits(client: str | None) -> None:
    ids = {new_request_id(client) for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"[0-9a-f]{32}", rid) for rid in ids)
