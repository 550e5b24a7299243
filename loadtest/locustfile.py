"""SDK-shaped load with locust: OpenAI-style users streaming chat and completions, TTFT and ITL as metrics.

Locust is for realistic client behaviour (think time, a user mix, long runs); it costs far more CPU per event
than ``loadtest.loadgen`` and is not precise enough for overhead numbers (use ``python -m loadtest.bench``).

Run headless, bounded in users and time (``--host`` is pdproxy or any OpenAI-compatible server)::

    locust -f loadtest/locustfile.py --headless -u 20 -r 5 -t 30s --host http://127.0.0.1:8000 \
        --only-summary --csv /tmp/pdproxy-locust

Environment: ``PDPROXY_LOCUST_MODEL`` (default: the first id of ``/v1/models``), ``PDPROXY_LOCUST_MAX_TOKENS``
(default 64), ``PDPROXY_LOCUST_LONG_WORDS`` (words in a long prompt, default 3000; short prompts have ~30),
``PDPROXY_LOCUST_LONG_SHARE`` (fraction of long prompts, default 0.2), ``PDPROXY_LOCUST_API_KEY`` (sent as
``Authorization: Bearer KEY`` on every request, for a pdproxy with ``api_keys``; default ``OPENAI_API_KEY``, as the
OpenAI SDK reads it; neither set: no header).

Metrics (locust request type ``metric``, "response time" = the value in ms): ``TTFT chat`` / ``TTFT
completions`` (request sent → first content event), ``ITL chat`` / ``ITL completions`` (each gap between
content events), ``E2E chat`` / ``E2E completions`` (request sent → ``data: [DONE]``).  Locust's own request rows,
``/v1/chat/completions stream: to headers`` and ``/v1/completions stream: to headers``, time a streamed request
only up to its response headers (locust stops the clock there for ``stream=True``; pdproxy sends the headers with
the first event), so they are a time to first byte, not an end-to-end time.  Locust's ``Aggregated`` row sums
every row, the metric rows too (one ``ITL`` entry per token gap): read requests per second from the request rows.  Prompts are unique text (a uuid and random words), so
no request hits the engines' prefix cache by accident.
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from typing import Any

from locust import HttpUser, between, events, task

_WORDS = ("river", "stone", "cloud", "lantern", "harbor", "meadow", "signal", "copper", "violet", "orbit", "canyon",
          "ember", "willow", "quartz", "falcon", "glacier", "saffron", "tundra", "beacon", "cedar")
MAX_TOKENS = int(os.environ.get("PDPROXY_LOCUST_MAX_TOKENS", "64"))
LONG_WORDS = int(os.environ.get("PDPROXY_LOCUST_LONG_WORDS", "3000"))
LONG_SHARE = float(os.environ.get("PDPROXY_LOCUST_LONG_SHARE", "0.2"))


def unique_prompt(words: int) -> str:
    """``words`` random words after a uuid: unique text, no shared prefix between requests."""
    return uuid.uuid4().hex + " " + " ".join(random.choices(_WORDS, k=words))


def _metric(name: str, value_ms: float) -> None:
    events.request.fire(request_type="metric", name=name, response_time=value_ms, response_length=0,
                        exception=None, context={})


class OpenAIUser(HttpUser):
    """One user: streams chat and completions requests, short prompts mostly, long ones sometimes."""

    wait_time = between(0.1, 1.0)

    def on_start(self) -> None:
        key = os.environ.get("PDPROXY_LOCUST_API_KEY") or os.environ.get("OPENAI_API_KEY")
        if key:
            self.client.headers["Authorization"] = f"Bearer {key}"
        self.model = os.environ.get("PDPROXY_LOCUST_MODEL")
        if self.model is None:
            with self.client.get("/v1/models", name="/v1/models", catch_response=True) as r:
                try:
                    self.model = r.json()["data"][0]["id"]
                except (ValueError, KeyError, IndexError, TypeError):
                    r.failure("no model listed: set PDPROXY_LOCUST_MODEL")
                    self.model = "sim-model"

    def _prompt(self) -> str:
        return unique_prompt(LONG_WORDS if random.random() < LONG_SHARE else 30)

    def _stream(self, api: str, body: dict[str, Any]) -> None:
        path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
        body.update(model=self.model, max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True})
        start = time.perf_counter()
        last: float | None = None
        # locust times a stream=True request up to its response headers, which pdproxy sends with the first event:
        # that row is a time to first byte, and is named so; the whole stream is the "E2E" metric below
        with self.client.post(path, json=body, name=f"{path} stream: to headers", stream=True,
                              catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            done = False
            buf = b""
            for chunk in r.iter_content(chunk_size=None):  # each chunk as it arrives (no 1 KB buffering)
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    data = event.removeprefix(b"data: ").strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        continue
                    if "error" in obj:
                        r.failure(f"error event: {obj['error']}")
                        return
                    choices = obj.get("choices") or []
                    if not choices:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        _metric(f"TTFT {api}", (now - start) * 1000)
                    else:
                        _metric(f"ITL {api}", (now - last) * 1000)
                    last = now
            if not done:
                r.failure("stream ended without data: [DONE]")
                return
            _metric(f"E2E {api}", (time.perf_counter() - start) * 1000)

    @task(3)
    def chat(self) -> None:
        self._stream("chat", {"messages": [{"role": "user", "content": self._prompt()}]})

    @task(2)
    def completions(self) -> None:
        self._stream("completions", {"prompt": self._prompt()})
