"""A minimal OTLP trace receiver on loopback, over HTTP and gRPC: what pdproxy's and vLLM's exporters send it.

Used by the tracing tests (``tests/tracing``), the real-engine trace check and ``loadtest.tracing_bench``.  It
decodes the OTLP protobuf messages of ``opentelemetry-proto`` (``ExportTraceServiceRequest``) into
:class:`ReceivedSpan` records and answers as a collector does:

- **OTLP/HTTP**: ``POST /v1/traces`` with an ``application/x-protobuf`` body (gzip accepted), answered with an
  ``ExportTraceServiceResponse`` — served by aiohttp in a background thread (:class:`HttpReceiver`);
- **OTLP/gRPC**: ``opentelemetry.proto.collector.trace.v1.TraceService/Export`` on a grpcio server
  (:class:`GrpcReceiver`).

Run as a process: ``python -m loadtest.otlp_receiver --http-port P [--grpc-port Q] [--out spans.jsonl]`` keeps
receiving until SIGTERM / SIGINT and writes one JSON line per span to ``--out`` (or only counts them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import orjson
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from loadtest.ports import free_port

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return _attributes(v.kvlist_value.values)
    if which == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, which) if which else None


def _attributes(kvs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    kv: KeyValue
    for kv in kvs:
        out[kv.key] = _value(kv.value)
    return out


@dataclass(slots=True)
class ReceivedSpan:
    """One span as received: ids in lower-case hex (``parent_span_id`` "" for a root), ``kind`` and
    ``status`` by name, times in epoch nanoseconds, ``events`` as ``{"name", "attributes"}``, ``resource`` the
    exporting process's resource attributes (``service.name`` …), ``transport`` "http" or "grpc"."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: str
    status_message: str
    events: list[dict[str, Any]]
    resource: dict[str, Any]
    scope: str
    transport: str


def decode(body: bytes, transport: str) -> list[ReceivedSpan]:
    """The spans of one serialized ``ExportTraceServiceRequest``."""
    req = trace_service_pb2.ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        resource = _attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(ReceivedSpan(
                    name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(), kind=KINDS.get(s.kind, str(s.kind)),
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano, attributes=_attributes(s.attributes),
                    status=STATUS.get(s.status.code, str(s.status.code)), status_message=s.status.message,
                    events=[{"name": e.name, "attributes": _attributes(e.attributes)} for e in s.events],
                    resource=resource, scope=ss.scope.name, transport=transport))
    return out


@dataclass
class SpanStore:
    """Spans received so far (thread-safe); ``sink`` (optional) is called with each batch as it arrives."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    sink: Callable[[list[ReceivedSpan]], None] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self.lock:
            self.spans.extend(spans)
            self.requests += 1
        if self.sink is not None:
            self.sink(spans)

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        """The spans of trace ``trace_id`` received so far."""
        return [s for s in self.snapshot() if s.trace_id == trace_id]

    def wait_for(self, cond: Callable[[list[ReceivedSpan]], Any], timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """Poll until ``cond(spans)`` is truthy; raise ``AssertionError`` with what arrived after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if cond(spans):
                return spans
            if time.monotonic() > deadline:
                names = [(s.name, s.trace_id[:8], s.transport) for s in spans]
                raise AssertionError(f"spans not received within {timeout_s} s; got {names}")
            time.sleep(0.02)

    def clear(self) -> None:
        with self.lock:
            self.spans.clear()


class HttpReceiver:
    """OTLP/HTTP on ``http://127.0.0.1:{port}/v1/traces`` (aiohttp in its own thread and event loop).
    ``fail_status``: answer every export with this status instead (an unavailable collector)."""

    def __init__(self, store: SpanStore | None = None, port: int | None = None) -> None:
        self.store = store or SpanStore()
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/traces"
        self.fail_status: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="otlp-http")
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        if self.fail_status is not None:
            return web.Response(status=self.fail_status)
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.store.add(decode(body, "http"))
        return web.Response(body=trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def _run(self) -> None:
        from aiohttp import web

        async def main() -> None:
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_post("/v1/traces", self._handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._stop = asyncio.Event()
            self._ready.set()
            await self._stop.wait()
            await runner.cleanup()

        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(main())
        self._loop.close()

    def start(self) -> HttpReceiver:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("OTLP/HTTP receiver did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def __enter__(self) -> HttpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class GrpcReceiver:
    """OTLP/gRPC on ``127.0.0.1:{port}`` (plaintext; ``endpoint`` is ``http://127.0.0.1:{port}``)."""

    def __init__(self, store: SpanStore | None = None, port: int | None = None) -> None:
        import grpc

        self.store = store or SpanStore()
        self.server = grpc.server(ThreadPoolExecutor(max_workers=4))
        store_ = self.store

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
            def Export(self, request: Any, context: Any) -> Any:  # the generated service method
                store_.add(decode(request.SerializeToString(), "grpc"))
                return trace_service_pb2.ExportTraceServiceResponse()

        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port or 0}")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> GrpcReceiver:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=1).wait(5)

    def __enter__(self) -> GrpcReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def receivers(grpc_too: bool = True) -> Iterator[tuple[HttpReceiver, GrpcReceiver | None]]:
    """An HTTP receiver and (``grpc_too``) a gRPC one sharing one :class:`SpanStore`."""
    store = SpanStore()
    with HttpReceiver(store) as http:
        if not grpc_too:
            yield http, None
            return
        with GrpcReceiver(store) as grpc_:
            yield http, grpc_


def main(argv: list[str] | None = None) -> int:
    """Run receivers until SIGTERM / SIGINT; print ``ready http=PORT grpc=PORT`` once listening and the span
    count at exit."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--http-port", type=int, default=0)
    ap.add_argument("--grpc-port", type=int, default=None, help="also serve OTLP/gRPC (0 = any free port)")
    ap.add_argument("--out", default=None, help="append one JSON line per span to this file")
    args = ap.parse_args(argv)
    out: IO[bytes] | None = open(args.out, "ab") if args.out else None  # noqa: SIM115 - closed below
    lock = threading.Lock()

    def sink(spans: list[ReceivedSpan]) -> None:
        if out is not None:
            with lock:
                out.write(b"".join(orjson.dumps(asdict(s)) + b"\n" for s in spans))
                out.flush()

    store = SpanStore(sink=sink)
    http = HttpReceiver(store, args.http_port or None).start()
    grpc_ = GrpcReceiver(store, args.grpc_port or None).start() if args.grpc_port is not None else None
    print(f"ready http={http.port} grpc={grpc_.port if grpc_ else ''}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    http.stop()
    if grpc_ is not None:
        grpc_.stop()
    if out is not None:
        out.close()
    print(f"spans={len(store.spans)} requests={store.requests}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
