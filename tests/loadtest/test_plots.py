"""``loadtest/plots.py`` turns a benchmark JSON document into the two PNGs RESULTS.md embeds: from the committed
full run, from a quick run's shape, and from documents missing scenarios, targets or fields."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from loadtest import plots

ROOT = Path(__file__).resolve().parents[2]
LATEST = ROOT / "loadtest" / "results" / "latest.json"

pytestmark = pytest.mark.timeout(60)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def test_series_from_the_committed_run() -> None:
    doc = orjson.loads(LATEST.read_bytes())
    ttft = plots.scenario_series(doc, "ttft_ms_p50")
    assert {"direct", "client_pd", "pdproxy", "vllm-router"} <= ttft.keys()
    xs = [x for x, _ in ttft["pdproxy"]]
    assert xs == sorted(xs) and xs[0] == pytest.approx(1.0, abs=0.5) and xs[-1] > 200  # idle … ≈300 streams
    assert ttft["pdproxy"][0][1] == doc["scenarios"]["idle"]["pdproxy"]["ttft_ms_p50"]
    cpu = plots.streams_series(doc, "proxy_us_per_event")
    level = doc["scenarios"]["streams"]["pdproxy"]["levels"][0]
    assert cpu["pdproxy"][0] == (level["streams"], pytest.approx(level["proxy_cpu_frac"] * 1e6 / level["events_per_s"]))
    figs = plots.cpu_figures(doc)
    assert figs["pdproxy"]["cpu_us_per_pd_request"] == doc["figures"]["pdproxy"]["cpu_us_per_pd_request"]
    assert set(figs) == {"pdproxy", "vllm-router"}


def test_command_writes_both_pngs(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "loadtest.plots", str(LATEST), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    written = [Path(line) for line in done.stdout.split()]
    assert [p.name for p in written] == ["latency.png", "cpu.png"]
    for p in written:
        w, h = png_size(p)
        assert w >= 1000 and h >= 400


@pytest.mark.parametrize("doc", [
    {},
    {"scenarios": {}, "figures": {}},
    {"scenarios": {"idle": {"pdproxy": {"ttft_ms_p50": 1.0}}, "streams": {"pdproxy": {"levels": [{"streams": 20}]}}}},
    {"scenarios": {"poisson_10": {"pdproxy": {"ttft_ms_p50": 2.0, "ttft_ms_p99": None, "concurrency_mean": "x"}},
                   "cpu_paced": {"pdproxy": {}}},
     "figures": {"pdproxy": {"cpu_us_per_event_paced": 30.0, "at_10": {}}, "other": None}},
    {"scenarios": {"idle": None, "streams": {"pdproxy": None}}, "figures": [], "machine": "?"},
])
def test_missing_fields_still_give_pngs(tmp_path: Path, doc: dict) -> None:  # type: ignore[type-arg]
    for p in plots.write_plots(doc, tmp_path):
        assert png_size(p)[0] > 0


def test_unreadable_document_is_a_usage_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert plots.main([str(bad)]) == 2
    assert plots.main([str(tmp_path / "missing.json")]) == 2
