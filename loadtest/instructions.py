"""Instructions per relayed event and per PD request, counted by valgrind (callgrind): a figure other load on
the machine does not move, to compare relay designs.

Run: ``python -m loadtest.instructions [--proxy NAME=COMMAND ...] [--streams 20] [--tokens 150] [--requests 200]``.

For each proxy command (template placeholders as in :mod:`loadtest.bench`: ``{python}``, ``{prefill}``,
``{decode}``, ``{port}``, ``{port2}``; default: ``pdproxy`` of this checkout) the proxy runs under
``valgrind --tool=callgrind --instr-atstart=no`` in front of two ``loadtest.fake_engine`` processes.  After a
warm-up, instrumentation is switched on (``callgrind_control -i on``) for exactly one workload and off again,
and the instructions executed in that interval (``Ir``, all threads; minus the idle process's rate, measured
first) are divided by what the client received:

- ``paced``: ``--streams`` streams of ``--tokens`` events at 10 events/s (one event per decoder write, on a 5 ms
  step grid), started over 1 s: instructions per relayed event, set-up of each stream included;
- ``requests``: ``--requests`` PD requests of one token, 8 at a time: instructions per PD request.

Valgrind runs the proxy ~50× slower, so the loads are small; the counts do not depend on the machine's speed or
load, but they do depend on batching (how many events one read carries), which is why the paced workload writes
one event per read.  Prints one JSON document.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from loadtest import fleet
from loadtest.bench import PDPROXY

QUIET = " --health-interval-s 3600 --engine-refresh-interval-s 3600"
"""Flags that keep pdproxy's background probes out of the measured interval (add them to a ``--proxy``)."""


def _callgrind(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True, timeout=60)


def _ir_total(out_dir: Path, timeout_s: float = 120.0, clear: bool = False) -> int:
    """Sum of ``Ir`` over the numbered dump files in ``out_dir`` (``totals:`` lines), waiting until at least one
    complete dump is there; ``clear``: delete them afterwards."""
    deadline = time.monotonic() + timeout_s
    while True:
        total, found = 0, False
        dumps = [f for f in out_dir.glob("callgrind.out*.*") if f.suffix[1:].isdigit()]
        for f in dumps:
            text = f.read_text(errors="replace")
            m = re.search(r"^totals:\s+(\d+)", text, re.M)
            if m:
                found = True
                total += int(m.group(1))
        if found or time.monotonic() > deadline:
            if clear:
                for f in dumps:
                    f.unlink()
            return total
        time.sleep(0.5)


@contextlib.contextmanager
def _killed(child: fleet.Child) -> Iterator[None]:
    """SIGKILL ``child``'s group on exit (a proxy under valgrind may outlive its SIGTERM drain), then reap it."""
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        child.stop()


def measure(name: str, template: str, args: argparse.Namespace) -> dict[str, Any]:
    """Both workloads against one proxy command under callgrind."""
    out: dict[str, Any] = {"command": template}
    prefiller, decoder = fleet.fake_engine("ir-prefiller", None), fleet.fake_engine("ir-decoder", None)
    with prefiller, decoder, tempfile.TemporaryDirectory(prefix="pdproxy-ir-") as tmp:
        out_dir = Path(tmp)
        wrapped = (f"valgrind --tool=callgrind --instr-atstart=no --dump-instr=no --compress-strings=no "
                   f"--callgrind-out-file={out_dir}/callgrind.out.%p ") + template
        child = fleet.proxy_child(f"ir-{name}", wrapped, prefiller.url, decoder.url, None)
        with _killed(child.start(timeout_s=300)):
            pid = child.pid
            warm = {"mode": "proxy", "target": child.url, "prefill": prefiller.url, "decode": decoder.url,
                    "max_tokens": 4, "arrival": {"kind": "batch", "n": 8, "ramp_s": 0.0}}
            fleet.run_loadgen(warm, None, 600)  # start-up work (first probes, imports on first use) done first
            time.sleep(2.0)
            _callgrind(pid, "-z")
            _callgrind(pid, "-i", "on")
            time.sleep(args.idle_s)
            _callgrind(pid, "-i", "off")
            _callgrind(pid, "-d")
            idle_rate = _ir_total(out_dir, clear=True) / args.idle_s
            out["idle_instructions_per_s"] = round(idle_rate)
            for workload, spec in (
                    ("paced", {"itl_s": 0.1, "tokens": args.tokens, "n": args.streams, "ramp_s": 1.0}),
                    ("requests", {"itl_s": 0.0, "tokens": 1, "n": args.requests, "ramp_s": args.requests / 40})):
                for url in (prefiller.url, decoder.url):
                    fleet.configure_engine(url, itl_s=spec["itl_s"], ttft_s=0.0, prefill_s=0.0, step_s=0.005)
                load = {"mode": "proxy", "target": child.url, "prefill": prefiller.url, "decode": decoder.url,
                        "max_tokens": spec["tokens"], "stall_gap_s": 30.0}
                fleet.run_loadgen({**load, "arrival": {"kind": "batch", "n": 4, "ramp_s": 0.0}}, None, 600)  # warm
                _callgrind(pid, "-z")
                _callgrind(pid, "-i", "on")
                time.sleep(1.0)  # a control command takes effect when the process next wakes: let it settle
                t0 = time.monotonic()
                w = fleet.run_loadgen({**load, "arrival": {"kind": "batch", "n": spec["n"], "ramp_s": spec["ramp_s"]}},
                                      None, 1200)["windows"][0]
                time.sleep(1.0)
                _callgrind(pid, "-i", "off")
                on_s = time.monotonic() - t0 + 1.0
                _callgrind(pid, "-d")
                ir = _ir_total(out_dir, clear=True) - idle_rate * on_s  # minus what the idle process costs
                per = w["events"] if workload == "paced" else w["requests"]
                out[workload] = {"instructions": round(ir), "events": w["events"], "requests": w["requests"],
                                 "errors": w["errors"],
                                 "instructions_per_" + ("event" if workload == "paced" else "request"):
                                     round(ir / per) if per else None}
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure every ``--proxy`` and print the JSON document; returns 0."""
    ap = argparse.ArgumentParser(prog="python -m loadtest.instructions", description=__doc__.split("\n")[0])
    ap.add_argument("--proxy", action="append", default=[], metavar="NAME=COMMAND")
    ap.add_argument("--streams", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=150)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--idle-s", type=float, default=3.0, help="idle window measured first (its rate is subtracted)")
    args = ap.parse_args(argv)
    proxies = dict(p.split("=", 1) for p in args.proxy) or {"pdproxy": PDPROXY + QUIET}
    doc = {name: measure(name, template, args) for name, template in proxies.items()}
    print(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
