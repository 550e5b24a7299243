"""The one status rule for an engine's in-band error object (:func:`pdproxy.errors.error_status`), and its two
users: a prefiller's error object in a 200 (:func:`pdproxy.apis.kv_transfer.error_answer`) and a decoder's error
as its first event (:func:`pdproxy.apis.chat.first_event_error`) give the same status for the same ``code``."""

from __future__ import annotations

import json

import orjson
import pytest

from pdproxy.apis.chat import first_event_error
from pdproxy.apis.kv_transfer import error_answer
from pdproxy.errors import error_status

MISSING = object()

# code → status: an int from 400 to 599 is the status; anything else is the engine's failure (500)
CODES: list[tuple[object, int]] = [
    (400, 400), (404, 404), (422, 422), (429, 429), (499, 499),   # client errors, edges included
    (500, 500), (503, 503), (599, 599),                           # server errors, edges included
    (399, 500), (200, 500), (0, 500), (-400, 500), (600, 500),    # out of range
    (None, 500), (MISSING, 500),                                   # no code
    (True, 500), (False, 500),                                     # a bool is no status
    ("404", 500), ("invalid_api_key", 500),                        # OpenAI-style string codes
    (404.0, 500), (1 << 70, 500),                                  # no int / out of range
]


@pytest.mark.parametrize(("code", "status"), CODES, ids=[repr(c) for c, _ in CODES])
def test_error_status(code: object, status: int) -> None:
    assert error_status(None if code is MISSING else code) == status


@pytest.mark.parametrize(("code", "status"), CODES, ids=[repr(c) for c, _ in CODES])
def test_a_prefillers_error_object_and_a_decoders_first_event_follow_the_rule(code: object, status: int) -> None:
    inner: dict[str, object] = {"message": "boom", "type": "BadRequestError", "param": None}
    if code is not MISSING:
        inner["code"] = code
    flat = error_answer({"object": "error", **inner}, "p0")
    envelope = error_answer({"error": inner}, "p0")
    data = json.dumps({"error": inner}).encode()        # json: orjson writes no int past 64 bits
    event = first_event_error(b"data: " + data + b"\n\n")
    assert flat is not None and envelope is not None and event is not None
    assert flat.status_code == envelope.status_code == event.status_code == status
    assert orjson.loads(flat.body_bytes())["error"]["code"] == status
    assert event.raw_body == data                       # the decoder's event as it sent it


@pytest.mark.parametrize("data", [b"{\"error\": not json}", b"{\"error\": \"boom\"}", b"{\"error\": [404]}",
                                  b"{\"error\": null}"])
def test_a_first_event_error_that_is_no_error_object_is_a_500(data: bytes) -> None:
    err = first_event_error(b"data: " + data + b"\n\n")
    assert err is not None and err.status_code == 500 and err.raw_body == data


def test_a_first_event_that_is_no_error_is_none() -> None:
    assert first_event_error(b'data: {"id": "x", "choices": []}\n\n') is None
