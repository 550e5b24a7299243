"""The one retry classification (:func:`pdproxy.errors.classify`) as a table, and the one error boundary
(:mod:`pdproxy.http.errors`): both transports' exceptions become the same pdproxy errors, judged alike."""

from __future__ import annotations

import httpx
import pytest

from pdproxy.errors import (
    Action,
    NoEndpointAvailable,
    ProxyError,
    UpstreamHTTPError,
    UpstreamRefused,
    UpstreamTimeout,
    UpstreamUnavailable,
    classify,
)
from pdproxy.http import client as h1
from pdproxy.http.errors import httpx_error, httpx_errors, role_noun, transport_error
from pdproxy.http.upstream import answer_too_large

FAIL_OVER, RETRY_ONCE, FAULT, UNWELL = (Action.FAIL_OVER, Action.RETRY_ONCE, Action.REQUEST_FAULT,
                                        Action.ENGINE_UNWELL)

# failure → (action, unsent, engine fault, retry at first, retry after the one more try)
TABLE: list[tuple[str, Exception, Action, bool, bool, bool, bool]] = [
    ("refused", UpstreamRefused("d0 refused", endpoint="d0"), FAIL_OVER, True, True, True, True),
    ("reset", UpstreamUnavailable("d0 reset", endpoint="d0"), FAIL_OVER, False, True, True, True),
    ("timeout", UpstreamTimeout("d0 timed out", endpoint="d0"), FAIL_OVER, False, True, True, True),
    ("502", UpstreamHTTPError(502, b"{}"), FAIL_OVER, False, True, True, True),
    ("503", UpstreamHTTPError(503, b"{}"), FAIL_OVER, False, True, True, True),
    ("504", UpstreamHTTPError(504, b"{}"), FAIL_OVER, False, True, True, True),
    ("500 engine dead", UpstreamHTTPError(500, b'{"error": {"message": "EngineCore encountered an issue. See stack '
                                                b'trace (above) for the root cause."}}'),
     RETRY_ONCE, False, True, True, False),
    ("500", UpstreamHTTPError(500, b"{}"), UNWELL, False, True, False, False),
    ("501", UpstreamHTTPError(501, b"{}"), UNWELL, False, True, False, False),
    ("505", UpstreamHTTPError(505, b"{}"), UNWELL, False, True, False, False),
    ("400", UpstreamHTTPError(400, b"{}"), FAULT, False, False, False, False),
    ("404", UpstreamHTTPError(404, b"{}"), FAULT, False, False, False, False),
    ("429", UpstreamHTTPError(429, b"{}"), FAULT, False, False, False, False),
    ("other", ProxyError("a bug"), FAIL_OVER, False, True, True, True),
]


@pytest.mark.parametrize(("exc", "action", "unsent", "engine_fault", "retry", "retry_again"),
                         [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_classify_table(exc: Exception, action: Action, unsent: bool, engine_fault: bool, retry: bool,
                        retry_again: bool) -> None:
    verdict = classify(exc)
    assert verdict.action is action
    assert verdict.unsent is unsent
    assert verdict.engine_fault is engine_fault
    assert verdict.retry() is retry
    assert verdict.retry(retried_once=True) is retry_again


def test_retry_after_is_read_from_the_engine_answer() -> None:
    assert classify(UpstreamHTTPError(503, b"", retry_after="7")).retry_after_s == 7.0
    assert classify(UpstreamHTTPError(503, b"")).retry_after_s is None
    assert classify(NoEndpointAvailable("decode")).retry_after_s is None


def _response(status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> httpx.Response:
    request = httpx.Request("GET", "http://10.0.0.5:8100/v1/models")
    return httpx.Response(status, content=body, headers=headers, request=request)


# the same failure through either transport → the same pdproxy error class
BOUNDARY: list[tuple[str, BaseException, type[ProxyError]]] = [
    ("h1 connect", h1.ConnectError("connect failed: refused"), UpstreamRefused),
    ("h1 pool", h1.PoolTimeout("no free connection"), UpstreamTimeout),
    ("h1 read timeout", h1.ReadTimeout("idle"), UpstreamTimeout),
    ("bare timeout", TimeoutError(), UpstreamTimeout),
    ("h1 disconnected", h1.Disconnected("closed"), UpstreamUnavailable),
    ("h1 protocol", h1.ProtocolError("bad status line"), UpstreamUnavailable),
    ("httpx connect", httpx.ConnectError("refused"), UpstreamRefused),
    ("httpx connect timeout", httpx.ConnectTimeout("slow"), UpstreamRefused),
    ("httpx pool", httpx.PoolTimeout("busy"), UpstreamTimeout),
    ("httpx read timeout", httpx.ReadTimeout("idle"), UpstreamTimeout),
    ("httpx reset", httpx.ReadError("reset"), UpstreamUnavailable),
    ("httpx protocol", httpx.RemoteProtocolError("bad"), UpstreamUnavailable),
]


@pytest.mark.parametrize(("exc", "cls"), [row[1:] for row in BOUNDARY], ids=[row[0] for row in BOUNDARY])
def test_both_transports_map_to_one_tree(exc: BaseException, cls: type[ProxyError]) -> None:
    if isinstance(exc, httpx.HTTPError):
        err = httpx_error(exc, "decoder http://10.0.0.5:8100", "d0", " mid-stream")
    else:
        assert isinstance(exc, h1.TransportError | TimeoutError)
        err = transport_error(exc, "decoder http://10.0.0.5:8100", "d0", " mid-stream")
    assert type(err) is cls
    assert err.endpoint == "d0"  # type: ignore[attr-defined]
    assert "10.0.0.5" not in err.body()["error"]["message"]       # the client never reads an engine's address


def test_httpx_error_status_keeps_the_engines_answer() -> None:
    resp = _response(503, b'{"error": "busy"}', {"retry-after": "3", "content-type": "application/json"})
    with pytest.raises(UpstreamHTTPError) as caught, httpx_errors("prefill p0", "p0"):
        resp.raise_for_status()
    err = caught.value
    assert (err.status_code, err.raw_body, err.retry_after) == (503, b'{"error": "busy"}', "3")
    assert classify(err).action is Action.FAIL_OVER and classify(err).retry_after_s == 3.0


def test_httpx_errors_leaves_other_exceptions_alone() -> None:
    with pytest.raises(KeyError), httpx_errors("prefill p0", "p0"):
        raise KeyError("x")


@pytest.mark.parametrize(("who", "noun"), [("prefill http://10.0.0.5:8100", "prefiller"),
                                           ("decode http://10.0.0.5:8100", "decoder"),
                                           ("decoder http://10.0.0.5:8100", "decoder"),
                                           ("engine http://10.0.0.5:8100", "engine"),
                                           ("Prefill http://10.0.0.5:8100", "Prefill")])
def test_an_answer_too_large_names_only_the_engines_role(who: str, noun: str) -> None:
    """The client reads the role (``Role.noun`` for a role's value, any other first word as it is), the log the
    engine's name and the limit (:func:`pdproxy.http.upstream.answer_too_large`)."""
    err = answer_too_large(who, "e0", 1 << 20)
    assert role_noun(who) == noun
    assert err.body()["error"]["message"] == f"the {noun} sent an answer too large to read"
    assert err.message.startswith(f"{who} answered more than 1,048,576 bytes") and err.endpoint == "e0"
