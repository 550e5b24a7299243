"""Token counting shared by the simulated engine and the proxy's admission code.

Two tokenizers implement :class:`Tokenizer`:

* :class:`SimTokenizer` – the built-in tokenizer of ``pdproxy sim``. It is deterministic, cheap and
  *byte-level bounded* (never more tokens than UTF-8 bytes). It uses a GPT-2-like pre-tokenizer regex, and
  every pre-token is one token id:

  - a letter run of up to 8 letters with an optional leading space (`` hello``) is one token. Longer runs
    split every 8 letters;
  - a run of up to 3 digits with an optional leading space is one token;
  - a run of up to 4 other symbols with an optional leading space is one token;
  - whitespace runs follow GPT-2's ``\\s+(?!\\S)|\\s+`` rule;
  - the special markers ``<|name|>`` (``name`` = lowercase letters/underscore) are one token each.

  So a text of N space-separated short ASCII words, each with a leading space, is exactly N tokens.
  :func:`sim_prompt` builds such texts. Chat template, with ``R`` = role::

      [<|tools|>{json of tools}<|end|>]  then per message: <|R|>{content}<|end|>  then [<|assistant|>]

  A message therefore costs its content tokens + 2. The generation prompt costs 1. With
  ``continue_final_message`` the last message has no ``<|end|>`` and no generation prompt is added.

* :class:`HFTokenizer` – a local Hugging Face tokenizer directory (``tokenizer.json`` plus an optional
  ``tokenizer_config.json`` with ``chat_template``). It is rendered with jinja2 the way transformers'
  ``apply_chat_template`` does (the variables ``messages``, ``tools``, ``add_generation_prompt``,
  ``bos_token``, ``eos_token``, ``raise_exception``, ``strftime_now`` and the ``chat_template_kwargs``).
  ``transformers`` is not required. Chat prompts are encoded with ``add_special_tokens=False``, like vLLM's
  chat path and ``/tokenize`` (``vllm/entrypoints/openai/chat_completion/serving.py``). Completion prompts
  are encoded with ``add_special_tokens=True``, like vLLM's completion renderer.

Multi-part chat content (OpenAI ``[{"type": "text", ...}, {"type": "image_url", ...}]``): the text parts are
joined with ``"\\n"``, as vLLM's "string" content format does. Each non-text part (image, audio, video)
counts as :data:`MEDIA_PART_TOKENS` tokens; those token ids are appended after the rendered prompt.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import jinja2

MEDIA_PART_TOKENS = 256
"""Tokens counted per image/audio/video content part. The real count depends on the model's processor;
256 is a typical tile budget. It is a fixed estimate, not vLLM's number."""

MEDIA_TOKEN_ID = 1
"""The token id used for the :data:`MEDIA_PART_TOKENS` placeholder tokens of a media part."""

SIM_VOCAB_SIZE = 1 << 20
"""Ids of :class:`SimTokenizer` lie in ``[0, SIM_VOCAB_SIZE)``."""

_PRETOKEN_RE = re.compile(
    r"<\|[a-z_]{1,24}\|>"
    r"|'(?:s|t|re|ve|m|ll|d)(?![^\W\d_])"
    r"| ?[^\W\d_]{1,8}"
    r"| ?\d{1,3}"
    r"| ?(?:[^\w\s]|_){1,4}"
    r"|\s+(?!\S)|\s+"
)
_SIM_WORD_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_FILLER_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "runs", "far", "away")


@runtime_checkable
class Tokenizer(Protocol):
    """What the proxy and the simulator need from a tokenizer.

    ``encode`` returns token ids for plain text. ``decode`` maps ids back to text. ``render_chat`` applies
    the chat template and returns the prompt *text* (encode it separately).
    """

    name: str

    def encode(self, text: str) -> list[int]:
        """Token ids of plain ``text`` (no special tokens unless an implementation's option adds them)."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ``ids``."""

    def render_chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """The chat template applied to ``messages`` (and ``tools``), as prompt text; the
        flags mean what they mean in vLLM's chat request (``add_generation_prompt``, ``continue_final_message``,
        ``chat_template_kwargs``)."""


class SimTokenizer:
    """The deterministic built-in tokenizer (see the module docstring for its rules and chat template).

    Ids are stable across processes: ``crc32(utf-8 of piece) mod SIM_VOCAB_SIZE``, computed in bulk (C-level
    ``map``), so a 200K-token prompt encodes without a Python call per token. ``decode`` uses a per-instance
    memo of the pieces ``encode`` saw (at most ``memo_limit`` entries). It falls back to ``" w<id>"`` for
    ids it has never seen. :meth:`count` counts without building ids.
    """

    name = "sim"

    def __init__(self, memo_limit: int = 500_000) -> None:
        self._memo_limit = memo_limit
        self._id_to_piece: dict[int, str] = {}

    def pieces(self, text: str) -> list[str]:
        """The pre-tokens of ``text``; ``"".join(pieces(t)) == t`` for every string."""
        return _PRETOKEN_RE.findall(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (one per pre-token; ``len(result) <= len(text.encode())``)."""
        pieces = _PRETOKEN_RE.findall(text)
        ids = list(map(SIM_VOCAB_SIZE.__rmod__, map(zlib.crc32, map(str.encode, pieces))))
        if len(self._id_to_piece) < self._memo_limit:
            self._id_to_piece.update(zip(ids, pieces, strict=True))
        return ids

    def count(self, text: str) -> int:
        """``len(encode(text))``, faster. Text made only of letter words separated by single spaces (what
        :func:`sim_prompt` builds) is counted with C-level string operations alone."""
        fast = _count_words(text)
        return fast if fast is not None else _PRETOKEN_RE.subn("", text)[1]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; exact for ids produced by this instance's ``encode``."""
        get = self._id_to_piece.get
        return "".join(get(i) or f" w{i}" for i in ids)

    def render_chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """Render with the fixed sim template. Raises ``ValueError`` for a message without a valid role."""
        parts: list[str] = []
        if tools:
            parts.append("<|tools|>" + json.dumps(tools, separators=(",", ":")) + "<|end|>")
        last = len(messages) - 1
        for i, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else None
            if not isinstance(role, str) or not re.fullmatch(r"[a-z_]{1,24}", role):
                raise ValueError(f"invalid chat message role: {role!r}")
            content = _content_text(message.get("content"))
            if message.get("tool_calls"):
                content += json.dumps(message["tool_calls"], separators=(",", ":"))
            end = "" if continue_final_message and i == last else "<|end|>"
            parts.append(f"<|{role}|>{content}{end}")
        if add_generation_prompt and not continue_final_message:
            parts.append("<|assistant|>")
        return "".join(parts)


class HFTokenizer:
    """A local Hugging Face tokenizer directory (``tokenizer.json`` + optional ``tokenizer_config.json``).

    Raises ``FileNotFoundError`` if ``tokenizer.json`` is missing. ``render_chat`` raises ``ValueError`` if
    the directory has no chat template, or if the template calls ``raise_exception``.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HFTok

        directory = Path(path)
        self.name = str(directory)
        self._tok = _HFTok.from_file(str(directory / "tokenizer.json"))
        config_path = directory / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        self._special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token",
                                                                   "pad_token")}
        self._templates = _templates_of(config.get("chat_template"))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS/EOS as the tokenizer's post-processor says."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens kept)."""
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def render_chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """Render ``tokenizer_config.json``'s ``chat_template`` with jinja2, as transformers does.  The request's
        own ``add_generation_prompt`` / ``continue_final_message`` win over ``chat_template_kwargs``' (vLLM merges
        them so: ``ChatCompletionRequest.build_chat_params``).  Raises ``ValueError`` when the template refuses or
        cannot render the messages — ``raise_exception``, or any error while rendering (a kwarg naming
        ``messages`` / ``tools``, a message of the wrong shape), which vLLM answers 400
        (``renderers/hf.py::safe_apply_chat_template``); a template that does not compile raises jinja2's error."""
        import jinja2

        if not self._templates:
            raise ValueError(f"tokenizer {self.name} has no chat_template")
        source = self._templates.get("tool_use") if tools and "tool_use" in self._templates else None
        source = source or self._templates.get("default") or next(iter(self._templates.values()))
        template = _jinja_env().from_string(source)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError("chat_template_kwargs must be an object")
        variables: dict[str, Any] = {**self._special, **{k: v for k, v in (chat_template_kwargs or {}).items()
                                                          if k not in _REQUEST_OWNED_KWARGS}}
        try:
            plain = [_as_vllm_renders(m) for m in messages]
            rendered = template.render(messages=plain, tools=_tools_as_vllm_renders(tools), add_generation_prompt=(
                add_generation_prompt and not continue_final_message), **variables)
        except ValueError:
            raise
        except (TypeError, AttributeError, KeyError, IndexError, jinja2.TemplateError) as exc:
            raise ValueError(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") from exc
        if continue_final_message and plain:
            final = _content_text(plain[-1].get("content")).strip()
            cut = rendered.rfind(final) if final else -1
            if cut >= 0:
                rendered = rendered[:cut + len(final)]
        return rendered


def load_tokenizer(path: str | None) -> Tokenizer:
    """``None`` → :class:`SimTokenizer`; a directory holding ``tokenizer.json`` → :class:`HFTokenizer`.

    Raises ``FileNotFoundError`` for a path without ``tokenizer.json``.
    """
    if path is None:
        return SimTokenizer()
    if not (Path(path) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    return HFTokenizer(path)


def prompt_token_ids(tok: Tokenizer, body: dict[str, Any], api: Literal["chat", "completions"]) -> list[int]:
    """Token ids of the prompt that vLLM would build from a request ``body``.

    chat: ``render_chat(messages, tools, add_generation_prompt, continue_final_message, chat_template_kwargs)``
    then encode without special tokens. ``tools`` are rendered whatever ``tool_choice`` says: vLLM drops them only
    with ``--exclude-tools-when-tool-choice-none`` (real vLLM 0.32 counted them with ``tool_choice: "none"``,
    ``tests/real_vllm/captures/chat_tools_none.json``). Media parts add :data:`MEDIA_PART_TOKENS` ids each.
    completions: a ``str`` prompt is encoded (with special tokens for HF tokenizers); a flat ``list[int]``
    is used as is (``[]`` too: an empty prompt is the caller's to refuse). Raises ``ValueError`` for a body it
    cannot count as *one* prompt: a missing prompt/messages, a prompt of another type, a list of prompts, or a
    malformed message.
    """
    if api == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        if not all(isinstance(m, dict) for m in messages):
            raise ValueError("each message must be an object")
        tools = body.get("tools") or None  # rendered even with tool_choice "none" (vLLM's default)
        text = tok.render_chat(messages, tools=tools,
                               add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                               continue_final_message=bool(body.get("continue_final_message", False)),
                               chat_template_kwargs=body.get("chat_template_kwargs"))
        ids = tok.encode(text)
        media = sum(_media_parts(m.get("content")) for m in messages)
        return ids + [MEDIA_TOKEN_ID] * (media * MEDIA_PART_TOKENS) if media else ids
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if isinstance(tok, HFTokenizer):
            return tok.encode(prompt, add_special_tokens=True)
        return tok.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)                                 # [] too: an empty prompt, the caller's to refuse
    if isinstance(prompt, list) and len(prompt) == 1:
        return prompt_token_ids(tok, {"prompt": prompt[0]}, "completions")
    if prompt is None:
        raise ValueError("'prompt' is required")
    if not isinstance(prompt, list):
        raise ValueError("'prompt' must be a string, a list of token ids, a list of strings or a list of token-id "
                         f"lists, got {type(prompt).__name__}")
    raise ValueError("a list of several prompts cannot be counted as one prompt")


def _count_words(text: str) -> int | None:
    """Exact SimTokenizer count for letter words split by single spaces with no trailing space, else None.

    Each such word (with its leading space) is ``ceil(len / 8)`` tokens. ``str.isalpha`` characters all fall in
    the regex's letter class.
    """
    if not text or text[-1] == " " or "  " in text or not text.replace(" ", "").isalpha():
        return None
    words = text.split(" ")
    empty_head = 1 if not words[0] else 0
    if max(map(len, words)) <= 8:
        return len(words) - empty_head
    return sum((n + 7) >> 3 for n in map(len, words))


def sim_prompt(n_tokens: int, unique: bool = False, seed: int = 0) -> str:
    """A text of exactly ``n_tokens`` :class:`SimTokenizer` tokens: ``n_tokens`` words, each ``" " + letters``.

    ``unique=False`` repeats a fixed filler sentence, so prompts share their prefixes and hit the prefix cache.
    ``unique=True`` makes every word distinct, from ``seed`` and the word's index (a running counter), so two
    different seeds share no prefix block. The result is the same for the same arguments.
    """
    if n_tokens <= 0:
        return ""
    if not unique:
        words = _FILLER_WORDS
        return "".join(" " + words[i % len(words)] for i in range(n_tokens))
    head = _letters(seed, 2)
    return "".join(" " + head + _letters(i, 6) for i in range(n_tokens))


def _letters(value: int, width: int) -> str:
    out = []
    for _ in range(width):
        value, digit = divmod(value, 26)
        out.append(_SIM_WORD_LETTERS[digit])
    return "".join(reversed(out))


def _as_vllm_renders(message: dict[str, Any]) -> dict[str, Any]:
    """A message as vLLM hands it to a chat template (``vllm/renderers/chat_utils.py``): list content joined to
    text, and each tool call's ``function`` as ``{"arguments": <parsed JSON>, "name": ...}`` (that key order)."""
    out = {**message, "content": _content_text(message.get("content"))} if isinstance(
        message.get("content"), list) else message
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        fixed = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    args = json.loads(fn["arguments"])
                except ValueError:
                    args = fn["arguments"]
                call = {**call, "function": {"arguments": args, "name": fn.get("name")}}
            fixed.append(call)
        out = {**out, "tool_calls": fixed}
    return out


def _tools_as_vllm_renders(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools as vLLM hands them to a chat template: the pydantic dump ``{"type", "function": {"name",
    "description" (null if absent), "parameters"}}`` (seen in ``tests/real_vllm/captures/tokenize_chat_tools.json``)."""
    if not tools:
        return tools
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict):
            tool = {"type": tool.get("type", "function"), "function": {
                "name": fn.get("name"), "description": fn.get("description"), "parameters": fn.get("parameters")}}
        out.append(tool)
    return out


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "\n".join(texts)
    raise ValueError("message content must be a string or a list of parts")


def _media_parts(content: Any) -> int:
    if not isinstance(content, list):
        return 0
    return sum(1 for p in content if isinstance(p, dict) and p.get("type") not in (None, "text"))


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _templates_of(value: Any) -> dict[str, str]:
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value if isinstance(t, dict) and "name" in t}
    return {}


_REQUEST_OWNED_KWARGS = frozenset({"add_generation_prompt", "continue_final_message"})
"""``chat_template_kwargs`` members the request's own fields override (vLLM: ``build_chat_params``)."""


def _jinja_env() -> jinja2.Environment:
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}…{% endgeneration %}``, which transformers' chat templates may use to mark the
        assistant's tokens (its ``AssistantTracker``): rendered as its body."""

        tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it an instance variable)

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
