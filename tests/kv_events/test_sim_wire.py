"""``pdproxy sim --kv-events-config`` sends what real vLLM 0.32 sends (``tests/real_vllm/captures/
kv_events_map.json``): the same frames, batch envelope, event keys and value types, and the same replay framing."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgspec
import zmq

from pdproxy.prefix.kv_events import END_SEQ, seq_frame
from tests.support import SimProcess, free_port, wait_until

CAPTURE = Path(__file__).resolve().parents[1] / "real_vllm" / "captures" / "kv_events_map.json"


def shape(value: Any) -> Any:
    """Keys and value types, recursively (lists by their first element)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def test_sim_events_have_the_real_engines_shape() -> None:
    real = json.loads(CAPTURE.read_text())
    first = [base64.b64decode(p) for p in real["messages"][0]]
    real_batch = msgspec.msgpack.decode(first[2])
    pub, rep = free_port(), free_port()
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
           "replay_endpoint": f"tcp://*:{rep}", "topic": real["topic"]}
    sim = SimProcess("prefill", "--block-size", "128", "--kv-events-config", json.dumps(cfg))
    ctx = zmq.Context()
    try:
        sim.start()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{pub}")
        tokens = real["requests"][0]["token_ids"]
        sim.client.post("/v1/completions", json={"model": "sim-model", "prompt": tokens, "max_tokens": 1})
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{rep}")

        def replayed() -> list[list[bytes]]:
            dealer.send_multipart([b"", seq_frame(0)])
            answers = []
            while dealer.poll(2000):
                answers.append(dealer.recv_multipart())
                if END_SEQ in answers[-1]:
                    return answers
            return []

        answers = wait_until(lambda: (a := replayed()) and len(a) == 2 and a, 10, 0.1, "the sim's first batch")
        assert [len(a) for a in answers] == [4, 4]                 # ["", topic, seq, payload], end marker
        assert answers[0][1] == first[0] and answers[0][2] == first[1] == seq_frame(0)
        assert answers[1][1:] == [b"", END_SEQ, b""]
        sim_batch = msgspec.msgpack.decode(answers[0][3])
        assert shape(sim_batch) == shape(real_batch)
        assert sim_batch[1][0]["token_ids"] == real_batch[1][0]["token_ids"]   # same prompt, same blocks
        assert sim_batch[1][0]["block_hashes"] != real_batch[1][0]["block_hashes"]  # hashes are the engine's own
        sub.close(0)
        dealer.close(0)
    finally:
        ctx.term()
        sim.stop()
