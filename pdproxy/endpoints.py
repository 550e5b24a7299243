"""Endpoints: one engine HTTP base URL with a role and, optionally, a data-parallel rank.

Topologies operators write (all end up as a flat list of :class:`Endpoint`):

- vLLM-Ascend's example proxy flags (``load_balance_proxy_server_example.py``):
  ``--prefiller-hosts h0 h1 --prefiller-ports 9100 9100 --decoder-hosts d0 d0 d0 d0 --decoder-ports 9100 9101 9102 9103``
  — external DP, one ``vllm serve --data-parallel-rank k --port base+k`` per rank, each its own endpoint;
- URL lists (``--prefill URL`` / ``--decode URL``) like vllm-router;
- one decoder URL fronting ``dp_size`` internal DP ranks: expanded to one endpoint per rank, addressed with the
  ``X-data-parallel-rank`` header (vLLM ``vllm/entrypoints/generate/base/serving.py::_get_data_parallel_rank``).
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

DP_RANK_HEADER = "X-data-parallel-rank"


class Role(enum.StrEnum):
    """What an endpoint does in PD disaggregation (values used in config, metric labels and logs)."""

    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def noun(self) -> str:
        """The engine's name in this role, as messages say it: ``"prefiller"`` / ``"decoder"``."""
        return "prefiller" if self is Role.PREFILL else "decoder"


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
    name: str = field(init=False, repr=False, compare=False)
    """Display / metrics label: the URL, plus ``#dp<rank>`` for an internal-DP rank (computed once: the request
    path reads it many times per request)."""
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", f"{self.url}#dp{self.dp_rank}" if self.internal_dp else self.url)
        object.__setattr__(self, "_hash", hash((self.url, self.role, self.dp_rank, self.internal_dp)))

    def __hash__(self) -> int:
        """The hash of the compared fields, computed once (an endpoint keys the pool's, health's, limits' and the
        ledger's dicts: several lookups per filter per request)."""
        return self._hash

    def __reduce__(self) -> tuple[type[Endpoint], tuple[str, Role, int | None, bool]]:
        """Pickled as its constructor's arguments: the cached hash is recomputed in the receiving process
        (``hash(str)`` is salted per process)."""
        return (Endpoint, (self.url, self.role, self.dp_rank, self.internal_dp))

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


_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
                       r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$")


def normalize_url(url: str) -> str:
    """Validate and normalise an engine base URL.

    Accepts ``http(s)://host[:port][/path]`` (a trailing ``/`` or ``/v1`` is dropped) or ``host:port``; the host
    is a DNS name or an IP address (IPv6 in brackets).  Anything else is refused at start with a readable
    ``ValueError`` rather than accepted and answered 503 later: a bare word (``notaurl``: no scheme and no
    port), an unknown scheme, credentials, a query or fragment, a ``.`` or ``..`` path segment (also
    percent-encoded) or a backslash, a port outside 1-65535.
    """
    raw = url.strip()
    shown = f"bad engine URL {url!r}"
    if not raw or any(c.isspace() for c in raw):
        raise ValueError(f"{shown}: give http://host:port (or host:port)")
    if "://" not in raw:
        parts = urlsplit("http://" + raw)
        try:
            bare_port = parts.port
        except ValueError as exc:
            raise ValueError(f"{shown}: {exc}") from None
        if bare_port is None or parts.path not in ("", "/", "/v1", "/v1/"):
            raise ValueError(f"{shown}: give http://host:port (or host:port); a bare name is not an engine URL")
        raw = "http://" + raw
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{shown}: scheme must be http or https")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{shown}: credentials do not belong in the URL (use engine_api_key)")
    if parts.query or parts.fragment:
        raise ValueError(f"{shown}: no query or fragment allowed")
    if any(unquote(seg) in (".", "..") for seg in parts.path.split("/")) or "\\" in parts.path:
        raise ValueError(f"{shown}: no dot segments or backslashes in the path (they name another path)")
    host = parts.hostname
    if not host:
        raise ValueError(f"{shown}: no host")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{shown}: {exc}") from None
    if port == 0:
        raise ValueError(f"{shown}: port must be 1-65535")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.match(host):
            raise ValueError(f"{shown}: {host!r} is not a host name or IP address") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    host = host if ":" not in host else f"[{host}]"
    netloc = f"{host}:{port}" if port else host
    return f"{parts.scheme}://{netloc}{path}"


def engine_identity(url: str) -> str:
    """``url`` (normalised: :func:`normalize_url`) in one spelling per engine, for telling whether two URLs name one
    engine: the host's DNS root dot dropped (``http://h.:9100`` and ``http://h:9100``), the scheme's default port
    written (``http://h`` and ``http://h:80``), an IPv6 address compressed (``[0:0::1]`` and ``[::1]``).  URLs keep
    their own spelling for connecting, as the operator wrote them (a fully qualified name skips the resolver's
    search list)."""
    parts = urlsplit(url)
    host = (parts.hostname or "").rstrip(".")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        host = f"[{address.compressed}]" if address.version == 6 else address.compressed
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts._replace(netloc=f"{host}:{port}").geturl()


def from_host_port_lists(hosts: list[str], ports: list[int], role: Role) -> list[str]:
    """Pair vLLM-Ascend-style ``--*-hosts`` and ``--*-ports`` lists into URLs, position by position.

    As in vLLM-Ascend's example proxy (``load_balance_proxy_server_example.py::parse_args``) the lists must have
    the same length — a host serving several DP-rank ports is repeated once per port — so a list one entry short
    can never pair engines silently.  Raises ``ValueError`` when they cannot be paired.
    """
    if not hosts and not ports:
        return []
    if len(hosts) != len(ports):
        raise ValueError(
            f"{role.value}: {len(hosts)} hosts but {len(ports)} ports; give one host per port, repeating a host "
            f"for each of its ports (e.g. --{'prefiller' if role is Role.PREFILL else 'decoder'}-hosts h0 h0 "
            f"--{'prefiller' if role is Role.PREFILL else 'decoder'}-ports 9100 9101)")
    return [normalize_url(f"[{h}]:{p}" if ":" in h and not h.startswith("[") else f"{h}:{p}")
            for h, p in zip(hosts, ports, strict=True)]


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


# vLLM's KV event publishers (``--kv-events``), parsed here so that the settings can check them
# (their subscriber: pdproxy/prefix/subscriber.py).


@dataclass(frozen=True, slots=True)
class KVEventSource:
    """One publisher: ``endpoint`` (the index location it feeds: ``Endpoint.name``), ``publisher`` (its PUB
    address, ``tcp://host:port``), ``replay`` (its replay ROUTER address or None), ``dp_rank`` (the
    ``data_parallel_rank`` its batches must carry, for internal-DP ranks; None = not checked) and ``topic``."""

    endpoint: str
    publisher: str
    replay: str | None = None
    dp_rank: int | None = None
    topic: str = ""


def parse_zmq_address(text: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` → ``(HOST, PORT)``; ``*`` as host means this machine.  Raises ``ValueError``."""
    raw = text.strip()
    if not raw.startswith("tcp://"):
        raise ValueError(f"bad KV events address {text!r}: expected tcp://HOST:PORT")
    host, sep, port = raw[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad KV events address {text!r}: expected tcp://HOST:PORT")
    return ("127.0.0.1" if host == "*" else host), int(port)


def parse_engine_address(entry: str) -> tuple[str, str]:
    """``ENGINE_URL=tcp://HOST:PORT`` → ``(normalized engine URL, tcp://HOST:PORT)``.  Raises ``ValueError``."""
    url, sep, address = entry.partition("=")
    if not sep:
        raise ValueError(f"bad KV events entry {entry!r}: expected ENGINE_URL=tcp://HOST:PORT")
    host, port = parse_zmq_address(address)
    return normalize_url(url), f"tcp://{host}:{port}"


def offset_port(address: str, rank: int) -> str:
    """``address`` with its port moved by ``rank`` (vLLM ``ZmqEventPublisher.offset_endpoint_port``)."""
    host, port = parse_zmq_address(address)
    return f"tcp://{host}:{port + rank}"


def build_sources(publishers: Iterable[str], replays: Iterable[str], endpoints: Iterable[Endpoint],
                  topic: str = "") -> list[KVEventSource]:
    """Sources for ``--kv-events URL=tcp://HOST:PORT`` (+ ``--kv-events-replay URL=tcp://HOST:PORT``) entries.

    An engine URL fronting internal DP ranks (several endpoints with ``internal_dp``) gets one source per rank
    on ``PORT + rank`` (and ``REPLAY_PORT + rank``), checked against each batch's ``data_parallel_rank``; any
    other URL gets one source on ``PORT`` (an external-DP rank ``k`` started with ``tcp://*:5557`` publishes on
    ``5557 + k``: write that port).  An entry's URL is matched to a configured one as :func:`engine_identity` tells
    (``http://h`` names ``http://h:80``).  A URL that is no configured endpoint still gets its source (it may be
    added later through the admin API).  Raises ``ValueError`` on a malformed entry or a replay entry whose URL
    has no ``--kv-events`` entry.
    """
    endpoints = list(endpoints)
    spelled = {engine_identity(ep.url): ep.url for ep in endpoints}     # an entry names its engine as configured

    def as_configured(entry: str) -> tuple[str, str]:
        url, address = parse_engine_address(entry)
        return spelled.get(engine_identity(url), url), address

    pubs = dict(as_configured(e) for e in publishers)
    reps = dict(as_configured(e) for e in replays)
    extra = sorted(set(reps) - set(pubs))
    if extra:
        raise ValueError(f"--kv-events-replay for {', '.join(extra)} without a --kv-events entry")
    ranks: dict[str, list[int]] = {}
    for ep in endpoints:
        if ep.internal_dp and ep.dp_rank is not None:
            ranks.setdefault(ep.url, []).append(ep.dp_rank)
    out: list[KVEventSource] = []
    for url, address in pubs.items():
        replay = reps.get(url)
        if url in ranks:
            for r in sorted(set(ranks[url])):
                out.append(KVEventSource(f"{url}#dp{r}", offset_port(address, r),
                                         offset_port(replay, r) if replay else None, r, topic))
        else:
            out.append(KVEventSource(url, address, replay, None, topic))
    return out
