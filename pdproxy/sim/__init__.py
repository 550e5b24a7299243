"""``pdproxy sim``: a simulated vLLM / vLLM-Ascend engine for demos, tests and benchmarks.

Modules: ``config`` (settings), ``cli`` (flags), ``server`` (HTTP routes, control API, :func:`running_sim`),
``api_routes`` (the routes beyond chat/completions), ``completion`` (the generation loop every generation route
shares), ``generation`` (output sequences, usage, the writer interface), ``outputs`` (what a sequence says: text,
token ids, logprobs, stops, JSON), ``protocol`` (chat/completions parsing), ``validation`` (vLLM's sampling-field
checks and error texts), ``errors`` (error envelopes), ``models`` (base model, LoRA adapters, 404),
``responses`` (chat/completions bodies and SSE), ``responses_api`` (``/v1/responses``), ``messages_api``
(``/v1/messages``), ``render_api`` (render routes, ``/inference/v1/generate``), ``pooling`` (pooling and audio
routes), ``scheduler`` (vLLM V1 step model, pure), ``kvcache`` (block pool, prefix cache), ``runner`` (asyncio
engine loop), ``connector`` (kv_transfer_params, KV pull), ``faults`` (fault injection), ``metrics``
(Prometheus text with vLLM's names).
"""

from __future__ import annotations

from pdproxy.sim.config import SimConfig

__all__ = ["SimConfig"]
