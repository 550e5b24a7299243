"""Endpoints: one engine HTTP base URL with a role and, optionally, a data-parallel rank.

Topologies operators write (all end up as a flat list of :class:`Endpoint`):

- vLLM-Ascend's example proxy flags (``load_balance_proxy_server_example.py``):
  ``--prefiller-hosts h0 h1 --prefiller-ports 9100 9100 --decoder-hosts d0 d0 d0 d0 --decoder-ports 9100 9101 9102 9103``
  — external DP, one ``vllm serve --data-parallel-rank k --port base+k`` per rank, each its own endpoint;
- URL lists (``--prefill URL`` / ``--decode URL``) like vllm-router;
- one decoder URL fronting ``dp_size`` internal DP ranks: expanded to one endpoint per rank, addressed with the
  ``X-data-parallel-rank`` header (vLLM ``entrypoints/openai/generate/base/serving.py::_get_data_parallel_rank``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from urllib.parse import urlsplit

DP_RANK_HEADER = "X-data-parallel-rank"


class Role(enum.StrEnum):
    """What an endpoint does in PD disaggregation (values used in config, metric labels and logs)."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One place requests can be sent.

    ``url``: base URL without trailing slash (``http://10.0.0.5:9100``); ``dp_rank``: the rank pinned with
    ``X-data-parallel-rank`` when ``internal_dp`` is true (one API server fronting several engine cores), or the
    informational rank of an external-DP port; ``name``: stable label for metrics and logs.
    """

    url: str
    role: Role
    dp_rank: int | None = None
    internal_dp: bool = False

    @property
    def name(self) -> str:
        """Display / metrics label: the URL, plus ``#dp<rank>`` for an internal-DP rank."""
        return f"{self.url}#dp{self.dp_rank}" if self.internal_dp else self.url

    @property
    def host(self) -> str:
        """Hostname of ``url`` (``""`` if it has none)."""
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        """TCP port of ``url`` (default 80, or 443 for ``https``)."""
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    def extra_headers(self) -> dict[str, str]:
        """Headers every request to this endpoint carries (the DP-rank pin for internal DP)."""
        if self.internal_dp and self.dp_rank is not None:
            return {DP_RANK_HEADER: str(self.dp_rank)}
        return {}


def normalize_url(url: str) -> str:
    """Validate and normalise an engine base URL.

    Accepts ``http://host:port`` (optionally with a trailing ``/`` or ``/v1``), or ``host:port``.
    Raises ``ValueError`` with a readable message for anything else.
    """
    raw = url.strip()
    if "://" not in raw:
        raw = "http://" + raw
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"bad engine URL {url!r}: scheme must be http or https")
    if not parts.hostname:
        raise ValueError(f"bad engine URL {url!r}: no host")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"bad engine URL {url!r}: {exc}") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    netloc = f"{host}:{port}" if port else host
    return f"{parts.scheme}://{netloc}{path}"


def from_host_port_lists(hosts: list[str], ports: list[int], role: Role) -> list[str]:
    """Pair vLLM-Ascend-style ``--*-hosts`` and ``--*-ports`` lists into URLs.

    As in the example proxy, one host with several ports repeats the host; one port with several hosts repeats
    the port; otherwise the lists must have the same length.  Raises ``ValueError`` when they cannot be paired.
    """
    if not hosts and not ports:
        return []
    if not hosts or not ports:
        raise ValueError(f"{role.value}: both hosts and ports are needed (got {len(hosts)} hosts, {len(ports)} ports)")
    if len(hosts) == 1 and len(ports) > 1:
        hosts = hosts * len(ports)
    if len(ports) == 1 and len(hosts) > 1:
        ports = ports * len(hosts)
    if len(hosts) != len(ports):
        raise ValueError(f"{role.value}: {len(hosts)} hosts but {len(ports)} ports; give one port per host")
    return [normalize_url(f"{h}:{p}") for h, p in zip(hosts, ports, strict=True)]


def expand(urls: list[str], role: Role, dp_size: int = 1) -> list[Endpoint]:
    """Turn URLs into endpoints; with ``dp_size > 1`` each URL becomes ``dp_size`` internal-DP endpoints.

    Raises ``ValueError`` on a duplicate URL within the role.
    """
    seen: set[str] = set()
    out: list[Endpoint] = []
    for raw in urls:
        url = normalize_url(raw)
        if url in seen:
            raise ValueError(f"duplicate {role.value} endpoint {url}")
        seen.add(url)
        if dp_size > 1:
            out.extend(Endpoint(url, role, dp_rank=r, internal_dp=True) for r in range(dp_size))
        else:
            out.append(Endpoint(url, role))
    return out
