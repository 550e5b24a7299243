"""``pdproxy sim``: a simulated vLLM / vLLM-Ascend engine for demos, tests and benchmarks.

Modules: ``config`` (settings), ``cli`` (flags), ``server`` (HTTP routes, control API, :func:`running_sim`),
``completion`` (the two completion routes), ``protocol`` (validation, errors), ``responses`` (bodies, SSE),
``scheduler`` (vLLM V1 step model, pure), ``kvcache`` (block pool, prefix cache), ``runner`` (asyncio
engine loop), ``connector`` (kv_transfer_params, KV pull), ``faults`` (fault injection), ``metrics``
(Prometheus text with vLLM's names).
"""

from __future__ import annotations

from pdproxy.sim.config import SimConfig

__all__ = ["SimConfig"]
