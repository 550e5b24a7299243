"""The models one simulated engine serves: its base model and LoRA adapters (``--lora-modules``), ``/v1/models``,
and vLLM's 404 for any other ``model``.

``--lora-modules`` takes vLLM's forms (``vllm/entrypoints/launchers/cli_args.py::LoRAParserAction``):
``name=path`` or a JSON object ``{"name", "path", "base_model_name"}``. ``/v1/models`` then lists, after the base
model card, one card per adapter with ``root`` = its path, ``parent`` = its base model and ``max_model_len`` null
(``vllm/entrypoints/openai/models/serving.py::OpenAIServingModels.show_available_models``, as real vLLM 0.32
answered: ``tests/real_vllm/captures/apis/models_lora.json``). A request naming an adapter is served like one for
the base model, and its answers echo the adapter's name in ``model``.

Unknown models (``check_model``): the generation and render routes answer 404 ``NotFoundError``
"The model `x` does not exist. Valid aliases: <base>." with ``param: "model"``; the pooling routes answer
"The model `x` does not exist." with ``param: null`` (both as captured).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pdproxy.sim.errors import SimHTTPError
from pdproxy.sim.validation import pydantic_error


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One adapter: its served ``name``, its ``path`` and the base model it applies to."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(items: tuple[str, ...] | list[str]) -> tuple[LoRAModule, ...]:
    """Parse ``--lora-modules`` values; raises ``ValueError`` for a malformed one."""
    out: list[LoRAModule] = []
    for item in items:
        if not item:
            continue
        if "=" in item and "," not in item and not item.lstrip().startswith("{"):
            name, path = item.split("=", 1)
            out.append(LoRAModule(name, path))
            continue
        try:
            spec = json.loads(item)
            out.append(LoRAModule(str(spec["name"]), str(spec["path"]), spec.get("base_model_name")))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"Invalid --lora-modules value {item!r}: {exc}") from None
    return tuple(out)


class ModelRegistry:
    """The base model (``served_model_name``, context ``max_model_len``) and its adapters."""

    def __init__(self, base: str, max_model_len: int, loras: tuple[LoRAModule, ...] = (),
                 root: str | None = None) -> None:
        self.base = base
        self.max_model_len = max_model_len
        self.root = root or base
        self.loras = {lora.name: lora for lora in loras}

    def resolve(self, model: Any, pooling: bool = False) -> str:
        """The served name a request's ``model`` field selects (absent → the base model). Raises vLLM's 404, or its
        request model's 400 for a ``model`` that is not a string (vLLM types it ``str | None``)."""
        if model is not None and not isinstance(model, str):
            raise pydantic_error("string_type", "model", "Input should be a valid string", model)
        if model is None or model == "" or model == self.base or model in self.loras:
            return self.base if not model else str(model)
        if pooling:
            raise SimHTTPError(404, f"The model `{model}` does not exist.", "NotFoundError")
        raise SimHTTPError(404, f"The model `{model}` does not exist. Valid aliases: {self.base}.",
                           "NotFoundError", "model")

    def cards(self) -> dict[str, Any]:
        """The ``/v1/models`` body."""
        created = int(time.time())

        def card(mid: str, root: str, parent: str | None, max_len: int | None) -> dict[str, Any]:
            return {"id": mid, "object": "model", "created": created, "owned_by": "vllm", "root": root,
                    "parent": parent, "max_model_len": max_len,
                    "permission": [{"id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission",
                                    "created": created, "allow_create_engine": False, "allow_sampling": True,
                                    "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                    "allow_fine_tuning": False, "organization": "*", "group": None,
                                    "is_blocking": False}]}

        data = [card(self.base, self.root, None, self.max_model_len)]
        data += [card(lora.name, lora.path, lora.base_model_name or self.base, None) for lora in self.loras.values()]
        return {"object": "list", "data": data}
