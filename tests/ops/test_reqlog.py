"""One structured JSON line per request at completion; no prompt text unless ``log_prompts``."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from pdproxy.ops.reqlog import LOGGER_NAME, RequestLog, request_record
from pdproxy.settings import load_settings
from pdproxy.timeline import RequestContext
from tests.conftest import Fleet
from tests.support import ProxyThread, wait_until

pytestmark = pytest.mark.timeout(30)

SECRET = "the secret prompt text 7f3a"


def _lines(path: Path, n: int) -> list[dict[str, Any]]:
    def read() -> list[dict[str, Any]] | None:
        if not path.exists():
            return None
        rows = [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]
        return rows if len(rows) >= n else None

    return list(wait_until(read, 5, 0.02, f"{n} request-log lines in {path}"))


def _proxy(sims: Fleet, **settings: Any) -> ProxyThread:
    return ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                       **settings).start()


def test_one_line_per_request_without_prompt_text(sims: Fleet, tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    p = _proxy(sims, request_log_path=str(path))
    try:
        body = {"model": "sim-model", "messages": [{"role": "user", "content": SECRET}], "max_tokens": 5,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", p.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "log-1"},
                          timeout=10) as r:
            assert r.status_code == 200
            streamed = r.read()
        usage = [json.loads(x[6:])["usage"] for x in streamed.decode().splitlines()
                 if x.startswith("data: {") and '"usage":{' in x.replace(" ", "")][-1]
        bad = httpx.post(p.url + "/v1/completions", json={"model": "sim-model", "prompt": "x", "n": 99}, timeout=10)
        assert bad.status_code == 400
        p.wait_idle()
    finally:
        p.stop()
    ok, rejected = _lines(path, 2)
    assert SECRET.encode() not in path.read_bytes()
    assert "messages" not in ok and "prompt" not in ok
    assert ok["event"] == "request" and ok["client_request_id"] == "log-1"
    assert ok["request_id"].startswith("log-1-")
    assert (ok["api"], ok["model"], ok["stream"], ok["status"], ok["outcome"]) == ("chat", "sim-model", True, 200, "ok")
    assert ok["prefiller"] == sims.prefillers[0].url
    assert ok["decoder"] in {d.url for d in sims.decoders}
    assert "dp_rank" in ok and ok["prompt_tokens"] > 0 and ok["cached_tokens"] is not None
    assert ok["engine_prompt_tokens"] == usage["prompt_tokens"]    # the engine's count, as the client's usage
    assert "continued_as" not in ok and "lost_decoders" not in ok  # only a continued stream has them
    assert ok["events"] >= 1  # relayed writes (a zero-cost decoder may deliver the whole stream in one)
    phases = ("admission_wait_s", "prefill_s", "pd_gap_s", "decode_first_token_s")
    assert all(ok[phase] is not None for phase in (*phases, "decode_s", "ttft_s")), ok
    assert ok["prefill_s"] > 0                     # a real round trip to the prefiller was timed
    # the phases are consecutive marks inside TTFT (arrived → admitted … → first token), and TTFT + decode = E2E
    assert sum(ok[phase] for phase in phases) <= ok["ttft_s"] + 1e-5
    assert ok["ttft_s"] + ok["decode_s"] == pytest.approx(ok["e2e_s"], abs=1e-5)
    assert (rejected["api"], rejected["status"], rejected["outcome"]) == ("completions", 400, "bad_request")
    assert rejected["rejection"] == "bad_request:n" and rejected["prefiller"] is None
    assert rejected["error"]


def test_log_prompts_adds_the_prompt(sims: Fleet, tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    p = _proxy(sims, request_log_path=str(path), log_prompts=True)
    try:
        r = httpx.post(p.url + "/v1/completions", json={"model": "sim-model", "prompt": SECRET, "max_tokens": 2},
                       timeout=10)
        assert r.status_code == 200
        p.wait_idle()
    finally:
        p.stop()
    (line,) = _lines(path, 1)
    assert line["prompt"] == SECRET


def test_default_goes_to_the_requests_logger(caplog: pytest.LogCaptureFixture) -> None:
    ctx = RequestContext(request_id="abc", client_request_id=None, api_label="completions", status=200)
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME), RequestLog(load_settings()) as log:
        log.emit(ctx, None)
    (rec,) = [r for r in caplog.records if r.name == LOGGER_NAME]
    assert orjson.loads(rec.getMessage()) == {**request_record(ctx, None), "ts": orjson.loads(rec.getMessage())["ts"]}


def test_disabled_log_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "off.jsonl"
    ctx = RequestContext(request_id="abc", client_request_id=None, api_label="chat")
    with RequestLog(load_settings(request_log=False, request_log_path=str(path))) as log:
        log.emit(ctx, None)
    assert not path.exists()


def test_a_line_after_the_log_closed_still_goes_to_its_file(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    # a forced shutdown (second Ctrl-C) cuts streams whose lines are written after the lifespan closed the log
    path = tmp_path / "requests.jsonl"
    ctx = RequestContext(request_id="late", client_request_id=None, api_label="chat", status=200)
    log = RequestLog(load_settings(request_log_path=str(path)))
    with log:
        pass
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        log.emit(ctx, None)
    assert [orjson.loads(x)["request_id"] for x in path.read_bytes().splitlines()] == ["late"]
    assert not [r for r in caplog.records if r.name == LOGGER_NAME]


def test_a_log_that_cannot_be_written_is_said_once_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    ctx = RequestContext(request_id="abc", client_request_id=None, api_label="chat")
    with caplog.at_level(logging.ERROR, logger="pdproxy"), \
            RequestLog(load_settings(request_log_path="/dev/full")) as log:   # every write: ENOSPC
        sink = log._sink
        for _ in range(3):
            log.emit(ctx, None)
    assert sink is not None and sink.dropped == 3   # written (and lost) by the writer thread before close
    errors = [r.getMessage() for r in caplog.records if r.name == "pdproxy"]
    assert len(errors) == 1 and "request log /dev/full unusable" in errors[0] and "No space left" in errors[0]


@pytest.fixture
def root_sink(tmp_path: Path) -> Any:
    """Installs ``pdproxy serve``'s root handler (``configure_logging``) writing to a file in ``tmp_path``, alone
    on the root logger as in the server (pytest's own capture handlers set aside); yields a reader of its lines."""
    from pdproxy.ops import logs

    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    path = tmp_path / "stderr.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def install(log_format: str) -> Callable[[], list[str]]:
        for h in list(root.handlers):
            root.removeHandler(h)
        handler = logs.SinkHandler(fd, 1 << 20)
        handler.setFormatter(logs.JsonFormatter() if log_format == "json" else logs.TextFormatter())
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        return lambda: path.read_text().splitlines()

    try:
        yield install
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
            h.close()
        for h in saved:
            root.addHandler(h)
        root.setLevel(level)
        os.close(fd)


def test_text_formatter_line_is_what_format_gives() -> None:
    from pdproxy.ops.logs import TextFormatter

    for tag in ("", "[w1]"):
        fmt = TextFormatter(tag)
        for created in (1764942000.0, 1764942000.0005, 1764942000.9999999, 1764942001.123456, 1764942001.999):
            record = logging.LogRecord(LOGGER_NAME, logging.INFO, __file__, 1, '{"event": "request"}', None, None)
            record.created, record.msecs = created, int((created - int(created)) * 1000) + 0.0   # as Python 3.11 sets
            assert fmt.line(LOGGER_NAME, "INFO", '{"event": "request"}', created) == fmt.format(record)


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_default_line_written_straight_through_the_root_handler(root_sink: Any, log_format: str) -> None:
    """With pdproxy's handler alone on the root, the line skips the LogRecord and is what a record would make;
    a filter or a handler an embedding program adds gets records again (and the line is the same)."""
    read = root_sink(log_format)
    ctx = RequestContext(request_id="abc", client_request_id=None, api_label="completions", status=200)
    seen: list[logging.LogRecord] = []

    class Keep(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            seen.append(record)
            return True

    logger = logging.getLogger(LOGGER_NAME)
    made: list[str] = []
    factory = logging.getLogRecordFactory()

    def counting(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        made.append(record.name)
        return record

    logging.setLogRecordFactory(counting)
    try:
        with RequestLog(load_settings()) as log:
            log.emit(ctx, None)                              # straight through: no LogRecord
            assert made == []
            logger.addFilter(keep := Keep())
            try:
                log.emit(ctx, None)                          # through a LogRecord
            finally:
                logger.removeFilter(keep)
    finally:
        logging.setLogRecordFactory(factory)
    assert made == [LOGGER_NAME] and len(seen) == 1
    lines = read()
    assert len(lines) == 2
    if log_format == "json":
        fast, slow = (orjson.loads(x) for x in lines)
    else:
        pattern = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO pdproxy\.requests (\{.*\})")
        matches = [pattern.fullmatch(x) for x in lines]
        assert all(matches), lines
        fast, slow = (orjson.loads(m.group(1)) for m in matches if m)
    assert fast == {**request_record(ctx, None), "ts": fast["ts"]} and slow == {**fast, "ts": slow["ts"]}


def test_a_handler_on_the_requests_logger_gets_every_line(root_sink: Any) -> None:
    root_sink("text")
    got: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(collect := Collect())
    try:
        with RequestLog(load_settings()) as log:
            log.emit(RequestContext(request_id="abc", client_request_id=None, api_label="chat"), None)
    finally:
        logger.removeHandler(collect)
    assert [orjson.loads(x)["request_id"] for x in got] == ["abc"]


def test_a_clients_megabytes_of_model_name_are_cut_in_the_line(sims: Fleet, tmp_path: Path) -> None:
    """A 2 MB ``model`` (no engine serves it: 404, whose message quotes it whole, as vLLM's does) makes a request
    line of kilobytes: ``model`` and ``error`` are cut (timeline.clip) — a line once held the name twice, 40 MB for
    a 20 MB name."""
    from pdproxy.timeline import MODEL_SHOWN_MAX, TEXT_SHOWN_MAX

    path = tmp_path / "requests.jsonl"
    proxy = _proxy(sims, request_log_path=str(path))
    try:
        wait_until(lambda: httpx.get(proxy.url + "/v1/models").json()["data"], 10, 0.05, "models listed")
        r = httpx.post(proxy.url + "/v1/chat/completions", timeout=20, json={
            "model": "m" * 2_000_000, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and len(r.content) > 2_000_000      # the answer quotes it, as vLLM's
        (line,) = _lines(path, 1)
    finally:
        proxy.stop()
    assert line["model"].startswith("m" * MODEL_SHOWN_MAX) and line["model"].endswith("…[+1999744 chars]")
    assert line["error"].startswith("The model `mmm") and len(line["error"]) < TEXT_SHOWN_MAX + 40
    assert len(path.read_bytes()) < 4 * TEXT_SHOWN_MAX
