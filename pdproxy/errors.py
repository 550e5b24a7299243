"""One error hierarchy, serialised in vLLM's error envelope at one boundary.

Envelope (vLLM ``vllm/entrypoints/serve/engine/protocol.py::ErrorResponse``)::

    {"error": {"message": str, "type": str, "param": str | None, "code": int}}

``code`` is the integer HTTP status.  ``type`` follows vLLM: ``BadRequestError`` for 400 (``Bad Request`` for a
request that fails vLLM's pydantic model, as its FastAPI handler says), ``NotFoundError`` for 404,
``InternalServerError`` for 500 …, and OpenAI's ``PermissionDeniedError`` for 403.

The boundary is :meth:`ProxyError.body` (and :func:`sse_error_event`, built on it): a client never sees an
engine's address nor a Python exception's text.  ``message`` keeps the full text — engine URL, host:port, the
transport's own words — for the log and the request's log line (``RequestContext.error``).  The client reads
``public`` when the error has one: a fixed sentence per failure kind, which a transport failure always has
(:mod:`pdproxy.http.errors`: "the connection to the decoder broke mid-stream", "the prefiller timed out"), so an
exception's text (``ConnectionResetError(104, …)``, a socket's address) never leaves the log.  Otherwise it reads
:func:`public_message` of ``message``: the same sentence with every URL, ``host:port``, IP address and ``('host',
port)`` tuple taken out, so "prefiller http://10.0.0.5:8100 did not answer within 30 s" becomes "prefiller did not
answer within 30 s" (pdproxy's own sentences, and the client's own input quoted back in a validation error, stay
as they are).  An engine's own error body (:class:`UpstreamHTTPError`) passes through unchanged: those are vLLM's
words about the request.

Tree::

    ProxyError (status 500)
    ├── BadRequest (400)             malformed body, unsupported combination
    │   └── PromptTooLong (400)      prompt (+ max_tokens) over max_model_len or the KV pool
    ├── PayloadTooLarge (413)
    ├── EdgeRefused (any)            the HTTP server refused a generation request itself (401, 413, 408…): counted
    ├── Unauthorized (401)           client, admin or metrics key missing or wrong (AuthenticationError)
    ├── Forbidden (403)              the admin API or debug routes are off, an engine outside admin_endpoint_allow
    ├── NotFound (404)               admin API: no such endpoint
    │   └── ModelNotFound (404)      no endpoint serves the request's ``model``
    ├── Conflict (409)               admin API: the endpoint already exists
    ├── Overloaded (429)             proxy-side queue full; carries Retry-After
    ├── QueueTimeout (503)           waited in the prefill queue past its deadline; carries Retry-After
    ├── NoEndpointAvailable (503)    no healthy prefiller/decoder; carries Retry-After
    ├── EnginesFailed (503)          the prefillers or decoders tried failed it (refused, reset, …): Retry-After
    ├── ShuttingDown (503)
    ├── UpstreamUnavailable (502)    connection reset, protocol broken, an unusable answer
    │   └── UpstreamRefused (502)    the connection could not be opened: the engine never saw the request
    ├── UpstreamTimeout (504)        a leg's deadline passed
    └── UpstreamHTTPError (any)      engine answered 4xx/5xx: status and body are passed through verbatim

The transports' own exceptions (pdproxy's HTTP/1.1 client for the legs, httpx for the control plane and
passthrough) become these classes in one place, :mod:`pdproxy.http.errors`; nothing above ``http/`` catches a
transport's exception.  What an engine failure means for the request and for the engine — another engine, one more
try, the client's fault, or an unwell engine — is :func:`classify`'s one table (used by both legs, passthrough and
health).
"""

from __future__ import annotations

import email.utils
import enum
import re
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

import orjson

from pdproxy.endpoints import Role

if TYPE_CHECKING:
    from pdproxy.endpoints import Endpoint

_TYPE_BY_STATUS: Final = MappingProxyType({
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    409: "ConflictError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "PayloadTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
})


def error_type_for(status: int) -> str:
    """vLLM-style ``error.type`` for an HTTP status (``BadRequestError`` for 400, …)."""
    return _TYPE_BY_STATUS.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


def error_status(code: object) -> int:
    """The HTTP status an engine's in-band error object stands for, from its ``code`` member (vLLM's
    ``ErrorResponse.code``, an int: ``vllm/entrypoints/serve/engine/protocol.py``): ``code`` itself when it is an
    int (not a bool) from 400 to 599, else 500 — a missing, null, string (OpenAI's ``"invalid_api_key"``, or
    ``"404"``), float or out-of-range code is the engine's failure.  Used for a prefiller's error object in a 200
    (:func:`pdproxy.apis.kv_transfer.error_answer`) and a decoder's error as its first event
    (:func:`pdproxy.apis.chat.first_event_error`; a Responses / Messages ``event: error``,
    ``pdproxy/apis/streams.py``).  Never raises."""
    return code if type(code) is int and 400 <= code < 600 else 500


# What an engine's address looks like inside pdproxy's own messages and the transport's exception texts.  The
# messages hold client text too (a model name, a field's value): every branch is linear in the message's length —
# a URL or a host starts only where a run of its characters starts (the lookbehinds), and a bracketed IPv6
# address's first colon is found without backtracking — so a 64 MB model name costs one pass, not its square
# (tests/security/test_error_redaction.py).
_ADDRESS = re.compile(
    r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://(?:\[[^\]\s]*\])?[^\s'\",)\]]*"   # a URL (#dpN, paths...)
    r"|\(\s*'[^']*'\s*,\s*\d+\s*(?:,\s*\d+\s*){0,2}\)"                  # ('10.0.0.5', 8100), ('::1', 8100, 0, 0)
    r"|\[[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*\](?::\d+)?"                      # [fd00::5]:8100
    r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"                          # 10.0.0.5, 10.0.0.5:8100
    r"|(?<![A-Za-z0-9.-])[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9-]+)*:\d{2,5}\b")  # d0.internal:9100
_EMPTY_BRACKETS = re.compile(r"(?<!\s)\s*(?:\(\s*\)|\[\s*\])")
_SPACES = re.compile(r"[ \t]{2,}")


def public_message(message: str) -> str:
    """``message`` without engine addresses (see module docstring); the words around them are kept."""
    if not _ADDRESS.search(message):
        return message
    text = _EMPTY_BRACKETS.sub("", _ADDRESS.sub("", message))
    text = _SPACES.sub(" ", text).replace(" :", ":").replace(" ,", ",").replace(" .", ".").replace(" ]", "]")
    return text.strip()


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
               error_type: str | None = None) -> dict[str, Any]:
    """Build vLLM's error envelope as a dict.

    ``code`` is the integer status as vLLM sends it, unless a string code (OpenAI's, such as
    ``context_length_exceeded``) is given, which then goes into ``error.code`` as OpenAI does.  ``message`` is
    used as given (callers with internal details pass :func:`public_message` of it).
    """
    return {
        "error": {
            "message": message,
            "type": error_type or error_type_for(status),
            "param": param,
            "code": code if code is not None else status,
        }
    }


class ProxyError(Exception):
    """Base of every error pdproxy answers itself.

    Attributes: ``status_code`` (HTTP status), ``message`` (full text, for logs), ``public`` (the client's fixed
    sentence; None: :func:`public_message` of ``message``), ``error_type`` (envelope ``type``), ``param``, ``code``
    (string code or None → the status), ``headers`` (extra response headers such as Retry-After), ``outcome``
    (metrics/log label), ``rejection``: ``(reason, detail)`` for ``pdproxy_rejections_total`` when the class
    declares it (None: :func:`pdproxy.ops.metrics.rejection_of` derives it).
    """

    status_code = 500
    outcome = "error"
    rejection: tuple[str, str] | None = None
    redacts = True
    """Whether the client reads :func:`public_message` of the message by default (False: an error about the
    client's own input — its fields, its model name — answered as written, as vLLM quotes them: a model named
    ``http://x/y`` or a prompt holding ``10:00`` is not an engine address)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, error_type: str | None = None,
                 redact: bool | None = None, public: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.public = public
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self._error_type = error_type
        self.redact = self.redacts if redact is None else redact

    @property
    def error_type(self) -> str:
        """The envelope's ``type``: as given, else the one for this status (see :func:`error_type_for`)."""
        return self._error_type or error_type_for(self.status_code)

    def note(self, text: str) -> None:
        """Add ``text`` (pdproxy's own words, e.g. "; the response is incomplete") to the message and to the
        client's sentence alike."""
        self.message += text
        if self.public is not None:
            self.public += text

    def client_message(self) -> str:
        """The sentence the client reads (see module docstring): ``public``, else ``message``, through
        :func:`public_message` — ``message`` as it is when not ``redact`` (the admin API's answers, whose caller
        holds the admin key and names the URLs; the client's own input quoted back)."""
        if not self.redact:
            return self.message
        return public_message(self.public if self.public is not None else self.message)

    def body(self) -> dict[str, Any]:
        """The error envelope the client gets: vLLM's, with :meth:`client_message`."""
        return error_body(self.status_code, self.client_message(), param=self.param, code=self.code,
                          error_type=self.error_type)

    def body_bytes(self) -> bytes:
        """:meth:`body` serialised as JSON bytes."""
        return orjson.dumps(self.body())


class InternalError(ProxyError):
    """A defect in pdproxy while it served the request (HTTP 500): the client reads "internal error in pdproxy",
    the log the exception's class (its traceback is logged where it was caught)."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(f"internal error in pdproxy: {exc.__class__.__name__}", public="internal error in pdproxy")


class BadRequest(ProxyError):
    """The request is malformed or asks for something PD cannot serve (HTTP 400)."""

    status_code = 400
    outcome = "bad_request"
    redacts = False      # pdproxy's 400s are about the request's own fields (ProxyError.redacts; not PromptTooLong)

    @classmethod
    def validation(cls, err: dict[str, Any]) -> BadRequest:
        """vLLM's 400 for one pydantic validation error ``err`` (``type``, ``loc``, ``msg``, ``input``, ``ctx``?), in
        its words (``serve/exception_handling/handlers/validation.py``: ``1 validation error:`` and the error's
        dict, ``type`` ``Bad Request``), ``param`` its ``loc``."""
        return cls(f"1 validation error:\n  {err}", param=err["loc"], error_type="Bad Request")


class PromptTooLong(BadRequest):
    """Prompt tokens (+ requested output tokens) exceed an engine limit (HTTP 400).

    The message keeps vLLM's and OpenAI's phrase "maximum context length" (client libraries detect context
    overflow by it); ``error.code`` stays the integer 400 as vLLM sends it, so a client
    sees the same envelope as from the engine.  ``limit_kind`` is ``"max_model_len"`` or ``"kv_pool"``.
    """

    outcome = "rejected_too_long"
    redacts = True       # the message names the engine whose limit it is (Limits.violation): filtered

    def __init__(self, message: str, *, limit_kind: str, prompt_tokens: int, limit: int,
                 param: str = "input_tokens") -> None:
        super().__init__(message, param=param)
        self.limit_kind = limit_kind
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class Unauthorized(ProxyError):
    """Missing or wrong credential (HTTP 401, as vLLM's ``--api-key`` check): the client API key when pdproxy
    enforces ``api_keys``, the admin key (admin API, debug routes), the metrics key."""

    status_code = 401
    outcome = "unauthorized"


class Forbidden(ProxyError):
    """No credential opens it (HTTP 403): the admin API or debug routes are off, or an admin request names an engine
    outside ``admin_endpoint_allow``."""

    status_code = 403
    outcome = "forbidden"


class Conflict(ProxyError):
    """The endpoint already exists, or removing it would leave its role without endpoints (HTTP 409)."""

    status_code = 409
    outcome = "conflict"


class NotFound(ProxyError):
    """No such endpoint (HTTP 404)."""

    status_code = 404
    outcome = "not_found"


class ModelNotFound(NotFound):
    """No endpoint of a role serves the request's ``model`` per its ``/v1/models`` (HTTP 404, ``param: model``), in
    vLLM's words (``vllm/entrypoints/serve/engine/serving.py::_check_model``).  ``served``: the model ids the
    endpoints do serve; ``other_role``: the other role, when its endpoints serve ``model`` (a deployment whose
    prefillers and decoders serve different names: said after vLLM's words)."""

    outcome = "model_not_found"
    redacts = False      # the client's model name, quoted as vLLM quotes it (ProxyError.redacts)

    def __init__(self, model: str, role: str, served: list[str], other_role: str | None = None,
                 pooling: bool = False) -> None:
        aliases = f" Valid aliases: {', '.join(served)}." if served and not pooling else ""
        split = (f" (`{model}` is served by {other_role} engines but by no {role} engine, and every request needs "
                 "both: check each engine's --served-model-name)") if other_role else ""
        super().__init__(f"The model `{model}` does not exist.{aliases}{split}", param=None if pooling else "model")
        self.model = model
        self.role = role
        self.served = served
        self.other_role = other_role
        self.rejection = ("model_not_found", role)

    def on_pooling_route(self) -> ModelNotFound:
        """The same 404 as vLLM's pooling routes word it: no aliases, ``param: null``
        (``tests/real_vllm/captures/pooling/error_embeddings_unknown_model.json``)."""
        return ModelNotFound(self.model, self.role, self.served, self.other_role, pooling=True)


class PayloadTooLarge(ProxyError):
    """The request body exceeds ``max_body_bytes`` (HTTP 413)."""

    status_code = 413
    outcome = "payload_too_large"


class EdgeRefused(ProxyError):
    """A generation route's request that pdproxy's HTTP server refused itself, before the application read it
    (``pdproxy/http/server.py``: the 401 of a missing client key, 413, 408, 431, 400, the 503 of the pending-body
    budget): not answered from here (the server wrote its answer), only counted and logged as the application's
    own refusals are.  ``outcome`` and ``rejection`` by status, from a closed set of labels."""

    _BY_STATUS: Final = MappingProxyType({401: ("unauthorized", ("unauthorized", "")),
                                          408: ("timeout", ("client_timeout", "")),
                                          413: ("payload_too_large", ("too_large", "body")),
                                          503: ("overloaded", ("pending_bodies", ""))})

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status
        self.outcome, self.rejection = self._BY_STATUS.get(status, ("bad_request", ("bad_request", "http")))


class Overloaded(ProxyError):
    """The proxy-side admission queue is full (HTTP 429 with Retry-After)."""

    status_code = 429
    outcome = "overloaded"


class QueueTimeout(ProxyError):
    """A request waited in pdproxy's prefill queue past its deadline (HTTP 503 with ``Retry-After``)."""

    status_code = 503
    outcome = "timeout"
    rejection: tuple[str, str] | None = ("deadline", "queue")

    def __init__(self, waited_s: float, retry_after_s: int = 1) -> None:
        super().__init__(f"the request waited {waited_s:.1f} s in pdproxy's prefill queue without a free prefiller "
                         "or decoder; retry later", headers={"retry-after": str(retry_after_s)})


class NoEndpointAvailable(ProxyError):
    """No healthy endpoint of a role can take the request (HTTP 503 with Retry-After)."""

    status_code = 503
    outcome = "no_endpoint"

    def __init__(self, role: str, detail: str = "", retry_after_s: int = 1) -> None:
        msg = f"No healthy {role} endpoint is available" + (f": {detail}" if detail else "")
        super().__init__(msg, headers={"retry-after": str(retry_after_s)})
        self.role = role


class EnginesFailed(ProxyError):
    """The endpoints of ``role`` tried for the request failed it (refused, reset, timed out) and none is left to try,
    or the attempts ran out (HTTP 503 with Retry-After, as :class:`NoEndpointAvailable` answers the next request —
    the client retries either alike).  Counted as the engines' failure (outcome ``upstream_error``), not as a
    rejection.  ``last``: the last failure, whose full message is this one's detail (the client reads its
    ``public`` sentence)."""

    status_code = 503
    outcome = "upstream_error"

    def __init__(self, role: Role, last: ProxyError, retry_after_s: int = 1) -> None:
        head = f"no {role.noun} could serve the request; retry later"
        super().__init__(f"{head}: {last.message}", headers={"retry-after": str(retry_after_s)},
                         public=f"{head}: {last.client_message()}")
        self.role = role
        self.last = last

    @staticmethod
    def after(role: Role, last: ProxyError, retry_after_s: int) -> ProxyError:
        """What the client gets when the endpoints of ``role`` tried ran out after ``last``: an engine's own error
        answer (a 502/503/504, a 500) as it sent it, else (refused, reset, timed out, an unusable answer) an
        :class:`EnginesFailed` with ``retry_after_s`` (until a breaker of that role re-admits an engine)."""
        return last if isinstance(last, UpstreamHTTPError) else EnginesFailed(role, last, retry_after_s)


class ShuttingDown(ProxyError):
    """pdproxy is draining after SIGTERM (HTTP 503 with Retry-After)."""

    status_code = 503
    outcome = "shutting_down"

    def __init__(self, retry_after_s: int = 5) -> None:
        super().__init__("pdproxy is shutting down; retry on another replica",
                         headers={"retry-after": str(retry_after_s)})


class UpstreamUnavailable(ProxyError):
    """An engine could not be reached, reset the connection or broke the protocol (HTTP 502).  ``answered``: the
    engine did answer — a status line, bytes that are no HTTP, a body that is no answer — so it read the request
    (False: a connection closed or reset before any answer byte, which may never have reached it)."""

    status_code = 502
    outcome = "upstream_error"

    def __init__(self, message: str, *, endpoint: str = "", headers: dict[str, str] | None = None,
                 public: str | None = None, answered: bool = False) -> None:
        super().__init__(message, headers=headers, public=public)
        self.endpoint = endpoint
        self.answered = answered


class UpstreamRefused(UpstreamUnavailable):
    """The connection could not be opened (refused, unreachable, connect timeout): the engine never saw the
    request, so e.g. the prefiller's KV handle is still intact and may go to another decoder."""


class UpstreamTimeout(ProxyError):
    """A leg's deadline passed; the upstream connection was closed (HTTP 504)."""

    status_code = 504
    outcome = "timeout"

    def __init__(self, message: str, *, endpoint: str = "", public: str | None = None) -> None:
        super().__init__(message, public=public)
        self.endpoint = endpoint


ENGINE_TEXT_CHARS = 200
"""Characters of an engine's non-JSON error body quoted in the envelope pdproxy answers instead
(:meth:`UpstreamHTTPError.body_bytes`)."""


class UpstreamHTTPError(ProxyError):
    """An engine answered an error status; its status and body reach the client verbatim."""

    outcome = "upstream_error"

    def __init__(self, status: int, body: bytes, *, endpoint: str = "", content_type: str = "application/json",
                 retry_after: str | None = None) -> None:
        super().__init__(f"engine {endpoint} answered HTTP {status}")
        self.status_code = status
        self.raw_body = body
        self.endpoint = endpoint
        # vLLM answers every error as a JSON object; anything else (a server's plain-text 500 from a crashed
        # handler, an HTML page from a gateway) is put in the envelope (body_bytes): a client gets the API's shape
        self.enveloped = not _json_object(body)
        self.content_type = "application/json" if self.enveloped else content_type
        self.retry_after = retry_after
        if retry_after:
            self.headers["retry-after"] = retry_after
        if 400 <= status < 500:
            self.outcome = "upstream_rejected"

    def body_bytes(self) -> bytes:
        """The engine's own error body (bytes, a JSON object) passed through verbatim; else a generated JSON
        envelope: with the start of the engine's text (at most :data:`ENGINE_TEXT_CHARS` characters, engine
        addresses removed) when it sent any."""
        if not self.enveloped:
            return self.raw_body
        message = f"engine answered HTTP {self.status_code}"
        text = " ".join(self.raw_body[:ENGINE_TEXT_CHARS].decode("utf-8", "replace").split())
        if text:
            message = public_message(f"{message}: {text}")
        return orjson.dumps(error_body(self.status_code, message))


def dumps_or_none(obj: Any) -> bytes | None:
    """``orjson.dumps(obj)`` (compact JSON bytes), or None when orjson cannot write ``obj`` — it raises
    ``TypeError`` (``orjson.JSONEncodeError``) for a document nested deeper than the 254 levels it writes, though
    it reads up to 1,023, so an engine's answer or event that ``orjson.loads`` read may not be written again.
    Each caller says what then happens (the document relayed as it came, or the engine's answer refused as one
    pdproxy cannot merge).  Here rather than beside the JSON helpers of :mod:`pdproxy.apis.request`: this module
    writes engine bodies too (:func:`sse_error_event`) and sits below ``apis`` (docs/architecture.md, "The import
    levels")."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return None


def _json_object(body: bytes) -> bool:
    """True when ``body`` is one JSON object (how vLLM answers every error)."""
    if body.lstrip()[:1] != b"{":
        return False
    try:
        return isinstance(orjson.loads(body), dict)
    except orjson.JSONDecodeError:
        return False


class DecodeFailed(Exception):
    """A decoder failed before its first event reached the client (internal: the director may fail over; raised by
    :mod:`pdproxy.pd.decode`).
    ``kv_intact``: the decoder never saw the request, so the prefiller's KV handle is still good; ``struck``: the
    failure was a strike against the decoder's breaker (not a non-streamed answer's timeout, which is no verdict)."""

    def __init__(self, error: ProxyError, endpoint: Endpoint, kv_intact: bool, struck: bool = True) -> None:
        super().__init__(error.message)
        self.error = error
        self.endpoint = endpoint
        self.kv_intact = kv_intact
        self.struck = struck


def sse_error_event(err: ProxyError | Exception) -> bytes:
    """An SSE error event as vLLM sends mid-stream: ``data: {"error": {...}}\\n\\n`` (an engine's own error
    object as it sent it; pdproxy's as :meth:`ProxyError.body` words it; any other exception a fixed sentence,
    its text only in the log)."""
    if isinstance(err, UpstreamHTTPError):
        try:
            parsed = orjson.loads(err.raw_body)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and "error" in parsed:
            written = dumps_or_none(parsed)           # None: nested past what orjson writes, pdproxy's words
            if written is not None:
                return b"data: " + written + b"\n\n"
    body = err.body() if isinstance(err, ProxyError) else error_body(502, "the upstream stream failed")
    return b"data: " + orjson.dumps(body) + b"\n\n"


def retry_after_seconds(value: str | None) -> float | None:
    """Parse a ``Retry-After`` header (delta-seconds or an HTTP-date, RFC 9110 §10.2.3) into seconds ≥ 0;
    None when absent or unparseable."""
    if not value:
        return None
    text = value.strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - time.time())


class Action(enum.Enum):
    """What a failed call to an engine means for the request (see :func:`classify`)."""

    FAIL_OVER = "fail_over"
    """The engine could not take it now (refused, reset, timed out, 502/503/504): try another engine."""
    RETRY_ONCE = "retry_once"
    """The engine's core died under it (a 500 with vLLM's ``EngineDeadError``): one more engine at most."""
    REQUEST_FAULT = "request_fault"
    """The request's own fault (a 4xx): the engine's answer goes to the client; no verdict on the engine."""
    ENGINE_UNWELL = "engine_unwell"
    """Any other 5xx (a 500 without a dead core, 501, 505, …): counted against the engine, but another one would
    answer the same."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """:func:`classify`'s answer.  ``action``: what to do with the request; ``unsent``: the engine never saw the
    request (the connection was refused), so a prefiller's KV handle sent to it is still intact and its breaker
    opens at once; ``retry_after_s``: the engine's ``Retry-After`` in seconds (None: not given)."""

    action: Action
    unsent: bool = False
    retry_after_s: float | None = None

    @property
    def engine_fault(self) -> bool:
        """True when the failure counts against the engine (its breaker, an immediate probe)."""
        return self.action is not Action.REQUEST_FAULT

    def retry(self, retried_once: bool = False) -> bool:
        """Whether another engine should get the request; ``retried_once``: a :attr:`Action.RETRY_ONCE` failure
        already had its one more try."""
        return self.action is Action.FAIL_OVER or (self.action is Action.RETRY_ONCE and not retried_once)


_FAIL_OVER_STATUS = frozenset({502, 503, 504})
"""Engine statuses that say "not me, not now" (a gateway's or vLLM's overload / dead-engine answers)."""
_REFUSED = Verdict(Action.FAIL_OVER, unsent=True)
_FAIL_OVER = Verdict(Action.FAIL_OVER)


ENGINE_DEAD_MESSAGE = b"EngineCore encountered an issue"
"""The start of vLLM's ``EngineDeadError`` message (``vllm/v1/engine/exceptions.py``), which its 500 carries."""


def classify_status(status: int, retry_after: str | None = None, body: bytes = b"") -> Verdict:
    """The verdict on an engine's HTTP answer ``status`` (≥ 400) with its ``Retry-After`` header value and error
    ``body``: 4xx → request's fault; 502/503/504 → fail over; a 500 whose body says the engine core died (vLLM's
    ``EngineDeadError``) → retry once; any other 500 or 5xx → engine unwell (no retry: vLLM 0.32 answers 503 for
    what is worth a retry, ``RetryableRequestError``, so another engine would fail the same way)."""
    if status < 500:
        return Verdict(Action.REQUEST_FAULT)
    action = (Action.FAIL_OVER if status in _FAIL_OVER_STATUS else
              Action.RETRY_ONCE if status == 500 and ENGINE_DEAD_MESSAGE in body else Action.ENGINE_UNWELL)
    return Verdict(action, retry_after_s=retry_after_seconds(retry_after))


def classify(exc: BaseException) -> Verdict:
    """The one retry classification of a failed call to an engine (both legs, passthrough, health):

    ==========================================  ============  ======  ============
    failure                                     action        unsent  engine fault
    ==========================================  ============  ======  ============
    :class:`UpstreamRefused` (not connected)    fail over     yes     yes
    :class:`UpstreamUnavailable`, reset, …      fail over     no      yes
    :class:`UpstreamTimeout`                    fail over     no      yes
    :class:`UpstreamHTTPError` 502/503/504      fail over     no      yes
    :class:`UpstreamHTTPError` 500, engine dead retry once    no      yes
    :class:`UpstreamHTTPError` other 500, 5xx   engine unwell no      yes
    :class:`UpstreamHTTPError` 4xx              request fault no      no
    any other exception                         fail over     no      yes
    ==========================================  ============  ======  ============
    """
    if isinstance(exc, UpstreamHTTPError):
        return classify_status(exc.status_code, exc.retry_after, exc.raw_body)
    if isinstance(exc, UpstreamRefused):
        return _REFUSED
    return _FAIL_OVER
