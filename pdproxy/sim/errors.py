"""The simulator's HTTP errors: vLLM's OpenAI envelope (``vllm/entrypoints/serve/engine/protocol.py::
ErrorResponse``) ``{"error": {"message", "type", "param", "code"}}``, and the Anthropic one the Messages routes use
for errors raised while serving (``vllm/entrypoints/anthropic/api_router.py::translate_error_response``)
``{"type": "error", "error": {"type", "message"}}``."""

from __future__ import annotations

import orjson


class SimHTTPError(Exception):
    """An HTTP error answered in vLLM's envelope (``status_code``, ``error_type``, ``param``)."""

    def __init__(self, status_code: int, message: str, error_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.param = param

    def body(self) -> bytes:
        """The JSON envelope bytes."""
        return error_body(self.message, self.error_type, self.status_code, self.param)

    def anthropic_body(self) -> bytes:
        """The Anthropic envelope bytes (``/v1/messages``, ``/v1/messages/count_tokens``)."""
        return orjson.dumps({"type": "error", "error": {"type": self.error_type, "message": self.message}})


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` as bytes."""
    return orjson.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}})
