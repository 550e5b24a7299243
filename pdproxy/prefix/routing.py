"""Prefix-cache-aware routing: the :class:`~pdproxy.prefix.source.PrefixSource` that tells the scheduler which
engine holds how much of each prompt, from the engines' KV events where they publish, from pdproxy's own record
elsewhere.

Per request, in :meth:`Director.run_pd <pdproxy.pd.director.Director.run_pd>` and the prefill leg::

    hints = await router.hints(req, ctx)      # token ids → block keys (off the loop) → PrefixCache.predict
    with router.prefilling(req, ctx, prefiller):   # on the scheduler's pick (uncached + queued prefill tokens)
        ... the prefill ...                   # in flight: later prompts count its blocks as cached there
    # answered: PrefixCache.record; ctx gets the predicted cached tokens

**Keys.**  Token ids come from the counting path (:meth:`Admission.prompt_token_ids
<pdproxy.admission.admission.Admission.prompt_token_ids>`): the local tokenizer with the chat template (worker thread, token
ids of repeated blocks cached), else the engine's ``/tokenize``; the block keys
(:func:`~pdproxy.prefix.index.block_keys`, one set per engine block size) are hashed in the same worker thread.
``prefix_keys: auto`` asks an engine's ``/tokenize`` only when some engine publishes KV events (precise routing
needs the engine's own tokens; a round trip per request); otherwise, and with ``prefix_keys: text``, the prompt is
rendered canonically (:func:`render_bytes`: tools, then each message's role and content) and hashed in byte
chunks that grow along the prompt (:func:`~pdproxy.prefix.index.text_keys`), which only the approximate index understands; their
token figures use the engine's tokens per byte as its answers show them (before the first answer:
admission's estimate).

**Modes** (``prefix_routing``), per endpoint: ``auto`` — precise where the endpoint's KV event publisher is live
(:meth:`PrefixCache.is_precise <pdproxy.prefix.cache.PrefixCache.is_precise>`), approximate elsewhere;
``precise`` — live publishers only (no hint for the others); ``approximate`` — pdproxy's own record only; ``off``
— no hints (the routing key is then the request id: pure load routing).  Decoders get hints only from their own
live publishers: vLLM's NixlConnector pulls only the blocks a decoder lacks (``docs/kv-events.md``), so a decoder
holding the prefix is cheaper to hand the request to, but where a decoder's cache stands is never guessed.

**In flight.**  A prompt dispatched to a prefiller and not answered yet counts there as cached for the prompts
routed meanwhile (:class:`InflightPrefixes`): they queue behind it in the engine and find its blocks computed. So
the first users of a new system prompt spread by load at once (the first one's prefiller is not left looking like
the only holder while the others compute theirs), and concurrent duplicates go where the work is already done.  An
answered prompt stays there a few seconds more where the engine's events will tell of it, until they have surely
been read; elsewhere the record below takes over at once (:meth:`PrefixRouter._settles`).

**Record.**  In ``auto`` and ``approximate``, every answered prefill is recorded in the approximate index
(:meth:`PrefixCache.record <pdproxy.prefix.cache.PrefixCache.record>`), also on engines with live events, so the
index is warm when a publisher goes silent.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from pdproxy.admission.admission import Admission
from pdproxy.apis.request import ProxyRequest
from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.control import EngineInfo
from pdproxy.engines.pool import EndpointPool
from pdproxy.prefix.cache import Prediction, PrefixCache
from pdproxy.prefix.index import MESSAGE_MARK, BlockKeys, block_keys, key_bytes, text_keys
from pdproxy.scheduling import NO_HINTS, PrefixHints
from pdproxy.settings import Settings
from pdproxy.timeline import RequestContext

DEFAULT_BLOCK_SIZE = 16
"""Block size (tokens) assumed for an engine that has not said (``vllm:cache_config_info``): vLLM's default."""

TEXT_KEYS_INLINE_BYTES = 1 << 20
"""Text keys of request bodies up to this size are hashed on the event loop (~60 µs for 250 KB: less than the
hop to a worker thread and back); larger ones in the admission's worker threads."""

KeyKind = Literal["tokens", "text"]


_MARK = MESSAGE_MARK.decode()
""":data:`~pdproxy.prefix.index.MESSAGE_MARK` as text: :func:`render_bytes` writes it before each part."""
_ROLE_END = "\x1f"
"""What :func:`render_bytes` writes between a message's role and its content (ASCII's unit separator)."""
_TOOLS_HEAD = f"{_MARK}tools{_ROLE_END}".encode()
"""What :func:`render_bytes` writes before a chat's tools (their JSON follows), as a message's role line."""


def render_bytes(body: dict[str, Any], chat: bool) -> bytes:
    """The canonical rendering of :func:`render_parts`, joined."""
    return b"".join(render_parts(body, chat))


def render_parts(body: dict[str, Any], chat: bool) -> list[bytes]:
    """A canonical rendering of a request's prompt for text keys, as UTF-8: a completion prompt as it is; a chat
    as its tools (JSON) then each message's role, text content and tool calls (JSON), each part after
    :data:`~pdproxy.prefix.index.MESSAGE_MARK` (``\x1e``; the role and its content apart by ``\x1f``).  A
    conversation's next turn renders as this turn's text plus its new messages, so text keys share its prefix, and
    the mark where its new messages begin ends a chunk there (:func:`~pdproxy.prefix.index.text_keys`).
    An id prompt renders as ``b""`` (it has token keys).

    Returned as its parts, each encoded on its own, for :func:`~pdproxy.prefix.index.text_keys` to hash without
    joining them: a 250 KB string content is copied once (its encoding; a list content once more, joining its text
    parts), where joining the parts copied it twice and a rendering as text, formatted then encoded, three times
    (the join was a third of the text keys' CPU in ``loadtest/users_bench.py``'s ``long_16``); the keys are the
    same."""
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return [prompt.encode("utf-8", "surrogatepass")] if isinstance(prompt, str) else []
    parts: list[bytes] = []
    tools = body.get("tools")
    if tools:
        parts += (_TOOLS_HEAD, orjson.dumps(tools))
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict)
                                and p.get("type") == "text")
        parts.append(f"{_MARK}{message.get('role')}{_ROLE_END}".encode("utf-8", "surrogatepass"))
        if isinstance(content, str) and content:
            parts.append(content.encode("utf-8", "surrogatepass"))
        if message.get("tool_calls"):
            parts.append(orjson.dumps(message["tool_calls"]))
    return parts


def cache_salt(req: ProxyRequest) -> str | None:
    """The request's ``cache_salt`` (vLLM's field on every generation API), or None when absent or not a
    non-empty string (vLLM refuses those before prefilling anything)."""
    salt = req.body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


@dataclass(slots=True)
class PrefixLookup:
    """One request's prefix view: ``keys`` per block size (token keys) or under its chunk size (text keys),
    ``kind``, ``predictions`` per endpoint name (those considered), ``block_sizes`` per endpoint name, ``hints``
    for the scheduler and ``token_count``: the prompt's length in the engine's tokens — exact from token ids, or
    for text keys estimated at the engine's tokens per byte once learnt — else None."""

    keys: dict[int, BlockKeys]
    kind: KeyKind
    predictions: dict[str, Prediction] = field(default_factory=dict)
    block_sizes: dict[str, int] = field(default_factory=dict)
    hints: PrefixHints = NO_HINTS
    token_count: int | None = None

    def keys_for(self, endpoint: str) -> BlockKeys | None:
        """The keys that describe this prompt on ``endpoint`` (None when it was not considered)."""
        if self.kind == "text":
            return next(iter(self.keys.values()), None)
        size = self.block_sizes.get(endpoint)
        return self.keys.get(size) if size is not None else None


class InflightPrefixes:
    """The keys of prefills dispatched and not answered yet, per endpoint name — and of those answered in the last
    ``settle_s`` seconds, until the engine's own ``BlockStored`` events (published after its step, read by the
    subscriber on this loop) have surely caught up: a conversation's next turn can arrive first.  Per endpoint a
    count per block key (chained keys: a key held means its whole prefix was sent), so a query walks the prompt's
    keys once, as the indexes do.  The engine's word ends that settling credit at once (:meth:`drop`): its cache
    cleared or restarted, or the blocks it evicted.  ``clock``: monotonic seconds."""

    def __init__(self, settle_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.settle_s = settle_s
        self.clock = clock
        self._held: dict[str, dict[int, int]] = {}
        self._answered: deque[tuple[float, str, Sequence[int]]] = deque()
        self._flying = 0

    def _take(self, endpoint: str, keys: Sequence[int]) -> None:
        held = self._held.get(endpoint)
        if held is None:
            return
        if len(held.keys() & keys) == len(keys) and max(map(held.__getitem__, keys), default=0) == 1:
            deque(map(held.__delitem__, keys), maxlen=0)     # held once each (the common case): C loops only
        else:
            for k in keys:
                n = held.get(k, 0) - 1
                if n > 0:
                    held[k] = n
                else:
                    held.pop(k, None)
        if not held:
            del self._held[endpoint]

    def _expire(self, now: float) -> None:
        answered = self._answered
        while answered and now - answered[0][0] > self.settle_s:
            _at, endpoint, keys = answered.popleft()
            self._take(endpoint, keys)

    def add(self, endpoint: str, keys: BlockKeys) -> None:
        """``keys``' prompt is being prefilled on ``endpoint``."""
        held = self._held.setdefault(endpoint, {})
        counts = dict.fromkeys(keys.keys, 1)              # C loops; Python only for the keys already held there
        for k in held.keys() & counts.keys():
            counts[k] = held[k] + 1
        held.update(counts)
        self._flying += 1

    def remove(self, endpoint: str, keys: BlockKeys, *, answered: bool = False) -> None:
        """That prefill ended: it failed (its keys go now), or the prefiller ``answered`` (kept ``settle_s``)."""
        self._flying -= 1
        now = self.clock()
        if answered:
            self._answered.append((now, endpoint, keys.keys))
        else:
            self._take(endpoint, keys.keys)
        self._expire(now)

    def drop(self, endpoint: str, keys: frozenset[int] | None = None) -> None:
        """The engine at ``endpoint`` said it no longer holds ``keys`` (a ``BlockRemoved``), or anything at all
        (None: ``AllBlocksCleared``, a restart): the answered prompts settling there stop counting from the first
        such block on (chained keys: the blocks after it are unreachable too).  Prefills still in flight keep
        their credit: the engine stores their blocks after this.  O(prompts settling)."""
        kept: deque[tuple[float, str, Sequence[int]]] = deque()
        for at, name, held_keys in self._answered:
            if name != endpoint:
                kept.append((at, name, held_keys))
                continue
            cut = 0 if keys is None else next((i for i, k in enumerate(held_keys) if k in keys), len(held_keys))
            self._take(endpoint, held_keys[cut:])
            if cut:
                kept.append((at, name, held_keys[:cut]))
        self._answered = kept

    def match(self, keys: BlockKeys, endpoint: str) -> int:
        """Tokens of ``keys``' prompt that a prefill in flight (or just answered) on ``endpoint`` computes."""
        self._expire(self.clock())
        held = self._held.get(endpoint)
        if not held:
            return 0
        n = 0
        for k in keys.keys:
            if k not in held:
                break
            n += 1
        return keys.cached_tokens(n) if n else 0

    def __len__(self) -> int:
        """Prompts in flight or settling."""
        return self._flying + len(self._answered)


class PrefixRouter:
    """Builds each request's :class:`~pdproxy.scheduling.PrefixHints` (see the module docstring).

    ``cache``: the prefix cache (precise + approximate indexes); ``admission``: the counting path (token ids, its
    worker threads); ``pool``: the endpoints; ``infos``: what each engine declared (block size, served models).
    """

    def __init__(self, settings: Settings, *, cache: PrefixCache, admission: Admission, pool: EndpointPool,
                 infos: Mapping[Endpoint, EngineInfo]) -> None:
        self.mode = settings.prefix_routing
        self.keys_setting = settings.prefix_keys
        self.text_chunk_chars = settings.prefix_text_chunk_chars
        self.cache = cache
        self.admission = admission
        self.pool = pool
        self.infos = infos
        self.engine_ids = bool(settings.kv_events) and settings.prefix_routing in ("auto", "precise")
        self.inflight = InflightPrefixes()
        cache.on_drop(self.inflight.drop)   # the engine's word (cleared, restarted, evicted) ends settling credit
        self.tokens_per_byte: dict[str, float] = {}
        """Text keys: per model, the engine's prompt tokens per rendered UTF-8 byte, learnt from the prefillers'
        answers (``usage.prompt_tokens``; a moving average), so a text prediction is in the engine's tokens."""

    # ---- per endpoint
    def block_size(self, endpoint: Endpoint) -> int:
        """The engine's block size in tokens: from its KV events or ``vllm:cache_config_info``, else
        :data:`DEFAULT_BLOCK_SIZE`."""
        known = self.cache.index.block_size(endpoint.name)
        if known:
            return known
        info = self.infos.get(endpoint)
        return info.block_size if info is not None and info.block_size else DEFAULT_BLOCK_SIZE

    def targets(self) -> list[tuple[Endpoint, bool, bool]]:
        """``(endpoint, precise allowed, approximate allowed)`` for every endpoint to predict: all prefillers;
        decoders whose publisher is live (precise only).  Empty when ``prefix_routing`` is ``off``."""
        mode = self.mode
        if mode == "off":
            return []
        precise, approx = mode in ("auto", "precise"), mode in ("auto", "approximate")
        out = [(e, precise, approx) for e in self.pool.endpoints(Role.PREFILL)]
        if precise:
            out.extend((e, True, False) for e in self.pool.endpoints(Role.DECODE) if self.cache.is_precise(e.name))
        return out

    def namespace(self, model: str | None) -> str:
        """The key namespace of ``model``: its name when an engine lists it as a LoRA adapter (a ``/v1/models``
        card with a ``parent``, as vLLM lists ``--lora-modules``), else ``""`` (the base model)."""
        if not model:
            return ""
        for info in self.infos.values():
            for card in info.models:
                if card.get("id") == model:
                    return model if card.get("parent") else ""
        return ""

    # ---- per request
    def _wants_tokens(self, req: ProxyRequest) -> bool:
        view, chat, _special = req.count_view()
        ids_prompt = not chat and isinstance(view.get("prompt"), list)
        if self.keys_setting == "text":
            return ids_prompt and not any(isinstance(p, str) for p in view["prompt"])
        return self.admission.source_for(req.model) not in ("engine", "estimate") or self.engine_ids or ids_prompt

    async def lookup(self, req: ProxyRequest, ctx: RequestContext) -> PrefixLookup | None:
        """Keys and predictions for ``req`` over :meth:`targets`; None when there is nothing to predict."""
        targets = self.targets()
        if not targets:
            return None
        namespace = self.namespace(req.model)
        sizes = {e.name: self.block_size(e) for e, _p, _a in targets}
        salt = cache_salt(req)
        lookup: PrefixLookup | None = None
        if self._wants_tokens(req):
            distinct = sorted(set(sizes.values()))

            def derive(ids: list[int]) -> tuple[int, dict[int, BlockKeys]]:
                return len(ids), {bs: block_keys(ids, bs, namespace, salt) for bs in distinct}

            got = await self.admission.prompt_token_ids(req, ctx, derive)
            if got is not None:
                lookup = PrefixLookup(got[1], "tokens", block_sizes=sizes, token_count=got[0])
        if lookup is None:
            view, chat, _special = req.count_view()
            text_namespace = namespace if salt is None else f"{namespace}\0cache_salt\0{salt}"
            derive_text = functools.partial(self._text_keys, view, chat, text_namespace, req.prompt_tokens,
                                            self.tokens_per_byte.get(req.model or ""))
            tk = derive_text() if len(req.raw) <= TEXT_KEYS_INLINE_BYTES else await self.admission.offload(
                derive_text, size=len(req.raw))
            calibrated = tk.num_tokens if (req.model or "") in self.tokens_per_byte else None
            lookup = PrefixLookup({tk.block_size: tk}, "text", block_sizes=sizes, token_count=calibrated)
        self._predict(lookup, targets)
        return lookup

    def _text_keys(self, body: dict[str, Any], chat: bool, namespace: str, tokens: int | None,
                   per_byte: float | None) -> BlockKeys:
        return text_keys(render_parts(body, chat), chunk_chars=self.text_chunk_chars, namespace=namespace,
                         num_tokens=tokens, tokens_per_byte=per_byte)

    def _predict(self, lookup: PrefixLookup, targets: Sequence[tuple[Endpoint, bool, bool]]) -> None:
        groups: dict[tuple[int, bool, bool], list[Endpoint]] = {}
        text = lookup.kind == "text"
        for e, precise, approx in targets:
            if text and not approx:
                continue                        # engines report token blocks: text keys only meet pdproxy's record
            size = next(iter(lookup.keys)) if text else lookup.block_sizes[e.name]
            groups.setdefault((size, precise and not text, approx), []).append(e)
        cached: dict[Endpoint, int] = {}
        flying = self.inflight if len(self.inflight) else None
        for (size, precise, approx), endpoints in groups.items():
            names = [e.name for e in endpoints]
            keys = lookup.keys[size]
            predicted = self.cache.predict(keys, names, precise=precise, approximate=approx)
            if flying is not None:                   # prefills in flight count as computed where they run
                for e in endpoints:
                    extra = flying.match(keys, e.name)
                    p = predicted.get(e.name)
                    if p is not None and extra > p.cached_tokens:
                        predicted[e.name] = Prediction(extra, p.precise)
            lookup.predictions.update(predicted)
            cached.update((e, predicted[e.name].cached_tokens) for e in endpoints
                          if e.name in predicted and predicted[e.name].cached_tokens)
        lookup.hints = PrefixHints(cached_tokens=cached, routing_key=self._routing_key(lookup, targets, cached))

    @staticmethod
    def _routing_key(lookup: PrefixLookup, targets: Sequence[tuple[Endpoint, bool, bool]],
                     cached: Mapping[Endpoint, int]) -> bytes | None:
        """The picker's tie-break key (8 bytes): the key of the prompt's first block that not every prefiller
        holds — its first block when none holds anything (so every replica, knowing nothing yet, places a new
        conversation the same way), the block after a system prompt that all of them hold (so users sharing it
        spread over the prefillers instead of all tying to one).  None for a prompt shorter than a block."""
        prefillers = [e for e, _p, _a in targets if e.role is Role.PREFILL]
        if lookup.kind == "text":
            keys = next(iter(lookup.keys.values()), None)
        else:
            sizes = [lookup.block_sizes[e.name] for e in prefillers]
            keys = lookup.keys.get(max(set(sizes), key=sizes.count)) if sizes else None
        if keys is None or not keys.keys or not prefillers:
            return None
        common = min(cached.get(e, 0) for e in prefillers)
        index = min(keys.blocks_within(common), len(keys.keys) - 1)
        return key_bytes(keys.keys[index])

    async def hints(self, req: ProxyRequest, ctx: RequestContext) -> PrefixHints:
        """The scheduler's hints for ``req`` (:data:`~pdproxy.scheduling.NO_HINTS` when ``prefix_routing`` is
        off).  Also sets ``req.prompt_tokens`` and ``ctx.prompt_tokens`` to :attr:`PrefixLookup.token_count` when
        known, so the scorers' prompt and cached tokens are in the same (the engine's) tokens: an exact count
        (token keys) always; a text estimate (bytes × the engine's learnt tokens per byte, which differs between
        languages several-fold) only where admission counted nothing exactly, and within admission's bounds when
        it had some — never above ``prompt_tokens_upper``, the size the engines' limits admitted, so the prefill
        queue never waits for room a prompt that fits would never find (where admission only estimated too, the
        engine-calibrated estimate replaces its own)."""
        lookup = await self.lookup(req, ctx)
        if lookup is None:
            return NO_HINTS
        req.prefix_lookup = lookup
        count = lookup.token_count
        if count is not None and lookup.kind == "text":
            if req.prompt_tokens_exact:
                count = None
            elif not req.prompt_tokens_estimated:       # bounded: within them (an estimate is no bound)
                upper = req.prompt_tokens_upper
                count = max(req.prompt_tokens_lower, count if upper is None else min(count, upper))
        if count is not None and count != req.prompt_tokens:
            req.prompt_tokens = ctx.prompt_tokens = count
        return lookup.hints

    @contextlib.contextmanager
    def prefilling(self, req: ProxyRequest, ctx: RequestContext, endpoint: Endpoint) -> Iterator[None]:
        """Around one prefill attempt of ``req`` on ``endpoint``: its keys are in flight there (see the module
        docstring) until it ends; when the prefiller answered (no exception), :meth:`prefilled`."""
        lookup = req.prefix_lookup
        keys = lookup.keys_for(endpoint.name) if isinstance(lookup, PrefixLookup) else None
        if keys is None or not keys.keys:
            yield
            return
        self.inflight.add(endpoint.name, keys)
        try:
            yield
        except BaseException:
            self.inflight.remove(endpoint.name, keys)
            raise
        self.inflight.remove(endpoint.name, keys, answered=self._settles(endpoint, keys))
        self.prefilled(req, ctx, endpoint)

    def _settles(self, endpoint: Endpoint, keys: BlockKeys) -> bool:
        """Whether an answered prompt keeps its in-flight credit on ``endpoint`` a few seconds more: only where a
        prediction for it comes from the engine's own KV events (token keys, a live publisher), until they have
        surely been read.  Elsewhere a prediction comes from the approximate index, where :meth:`prefilled`
        records the prompt in the same instant (modes ``auto`` / ``approximate``), or there is none (mode
        ``precise`` without a live publisher, and text keys there: :meth:`_predict`): settling held every answered
        prompt's keys ``settle_s`` seconds for nothing (4,000 prompts' worth at 800 requests/s, every ``add`` and
        ``remove`` paying for that table's size)."""
        return keys.kind == "tokens" and self.cache.is_precise(endpoint.name)

    def prefilled(self, req: ProxyRequest, ctx: RequestContext, endpoint: Endpoint) -> None:
        """``endpoint`` answered ``req``'s prefill: note the prediction for it on ``ctx``
        (``predicted_cached_tokens``, ``prefix_mode``: ``precise`` | ``approximate`` | ``text``) and record the
        prompt's keys there (modes ``auto`` and ``approximate``)."""
        lookup = req.prefix_lookup
        if not isinstance(lookup, PrefixLookup):
            return
        if endpoint not in self.pool:        # removed while it prefilled (admin API): what prefix routing knew of
            return                           # it went with it
        prediction = lookup.predictions.get(endpoint.name)
        if prediction is not None:
            ctx.predicted_cached_tokens = prediction.cached_tokens
            ctx.prefix_mode = "precise" if prediction.precise else (
                "text" if lookup.kind == "text" else "approximate")
        keys = lookup.keys_for(endpoint.name)
        if keys is not None and self.mode in ("auto", "approximate"):
            self.cache.record(endpoint.name, keys)
        if keys is not None and keys.kind == "text" and keys.num_chars and ctx.engine_prompt_tokens:
            seen = ctx.engine_prompt_tokens / keys.num_chars
            model = req.model or ""
            last = self.tokens_per_byte.get(model)
            self.tokens_per_byte[model] = seen if last is None else 0.8 * last + 0.2 * seen

    async def explain(self, req: ProxyRequest, ctx: RequestContext) -> dict[str, Any]:
        """``GET/POST /debug/prefix``: which endpoint holds how much of ``req``'s prompt, as a plain dict."""
        lookup = await self.lookup(req, ctx)
        if lookup is None:
            return {"prefix_routing": self.mode, "keys": None, "endpoints": []}
        rows = []
        for e, _p, _a in self.targets():
            p = lookup.predictions.get(e.name)
            rows.append({"name": e.name, "role": e.role.value, "dp_rank": e.dp_rank,
                         "cached_tokens": p.cached_tokens if p is not None else None,
                         "source": None if p is None else ("precise" if p.precise else "approximate"),
                         "publisher_live": self.cache.is_precise(e.name),
                         "block_size": lookup.block_sizes.get(e.name)})
        first = next(iter(lookup.keys.values()), None)
        return {"prefix_routing": self.mode, "keys": lookup.kind,
                "prompt_tokens": lookup.token_count if lookup.token_count is not None else req.prompt_tokens,
                "blocks": len(first.keys) if first is not None else 0, "endpoints": rows}
