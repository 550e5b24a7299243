"""Reading Prometheus text in tests: ``scrape(url)`` → :class:`Samples`, queried by name and labels."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


class Samples:
    """All samples of one scrape: ``(name, labels dict, value)``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.rows = [(s.name, dict(s.labels), s.value)
                     for fam in text_string_to_metric_families(text) for s in fam.samples]

    def find(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        """Samples named ``name`` whose labels include ``labels``."""
        return [(lab, v) for n, lab, v in self.rows if n == name and all(lab.get(k) == x for k, x in labels.items())]

    def value(self, name: str, **labels: str) -> float:
        """The one sample matching, or 0.0 when none does (a counter never incremented)."""
        found = self.find(name, **labels)
        assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples: {found}"
        return found[0][1] if found else 0.0

    def total(self, name: str, **labels: str) -> float:
        return sum(v for _, v in self.find(name, **labels))


def scrape(base_url: str) -> Samples:
    r = httpx.get(base_url + "/metrics", timeout=10)
    r.raise_for_status()
    assert r.headers["content-type"].startswith("text/plain")
    return Samples(r.text)
