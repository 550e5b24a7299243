"""Cost of building the decode leg's body (``kv_transfer.decode_body_bytes``) on multi-MB bodies.

Prints one JSON document: per body kind, CPU milliseconds (``time.process_time``, median of runs) of

- ``append_baseline``: the previous rule, measured in the same run (the client's bytes with the handle appended as
  a second ``kv_transfer_params`` member whatever the client sent);
- ``common``: the current rule when the client sent no proxy-owned member (the handle inserted: one copy);
- ``owned_removed``: the client sent a ``kv_transfer_params`` member, which is cut out byte-faithfully (top-level
  scan) before the handle is inserted;
- ``orjson_loads``: parsing the same body, for scale (pdproxy parses every body once anyway);

and ``common_ratio`` = common / append_baseline.  Run: ``.venv/bin/python -m loadtest.body_bench``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import orjson

from pdproxy.apis import kv_transfer

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(range(64))],
          "remote_engine_id": "e5f6", "remote_request_id": "chatcmpl-x", "remote_host": "10.0.0.5",
          "remote_port": 5600, "tp_size": 1}
HANDLE = kv_transfer.KVHandle.of(PARAMS)


def append_baseline(raw: bytes, params: dict[str, Any]) -> bytes:
    """The previous decode body: ``raw`` with a second ``kv_transfer_params`` member appended."""
    end = raw.rstrip().rfind(b"}")
    head = raw[:end].rstrip()
    return head + b',"kv_transfer_params":' + orjson.dumps(params) + b"}"


def bodies() -> dict[str, dict[str, Any]]:
    image = base64.b64encode(os.urandom(3_000_000)).decode()
    return {
        "chat_image_4MB": {"model": "m", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}}]}]},
        "completion_text_2MB": {"model": "m", "prompt": "word " * 400_000, "max_tokens": 64},
        "completion_ids_100k": {"model": "m", "prompt": list(range(100_000)), "max_tokens": 64},
        "chat_history_5k_messages": {"model": "m", "max_tokens": 64, "messages": [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} with some words in it " * 8}
            for i in range(5000)]},
    }


def cpu_ms(fn: Callable[[], object], runs: int) -> float:
    fn()
    samples = []
    for _ in range(runs):
        start = time.process_time()
        fn()
        samples.append((time.process_time() - start) * 1e3)
    return round(statistics.median(samples), 3)


def main() -> None:
    argparse.ArgumentParser(prog="python -m loadtest.body_bench", description=(__doc__ or "").split("\n\n")[0],
                            epilog="No options: it runs every body kind and prints one JSON document.").parse_args()
    report: dict[str, Any] = {"unit": "CPU ms per body (median)", "bodies": {}}
    for name, body in bodies().items():
        raw = orjson.dumps(body)
        parsed = orjson.loads(raw)
        owned = raw[:-1] + b',"kv_transfer_params":{"remote_host":"client"}}'
        owned_parsed = orjson.loads(owned)
        row = {
            "mb": round(len(raw) / 1e6, 2),
            "append_baseline": cpu_ms(lambda raw=raw: append_baseline(raw, PARAMS), 30),
            "common": cpu_ms(lambda raw=raw, parsed=parsed: kv_transfer.decode_body_bytes(raw, HANDLE, parsed), 30),
            "owned_removed": cpu_ms(lambda owned=owned, owned_parsed=owned_parsed: kv_transfer.decode_body_bytes(
                owned, HANDLE, owned_parsed), 10),
            "orjson_loads": cpu_ms(lambda raw=raw: orjson.loads(raw), 10),
        }
        row["common_ratio"] = round(row["common"] / row["append_baseline"], 3) if row["append_baseline"] else None
        report["bodies"][name] = row
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
