"""The seam between the stream relay (:mod:`pdproxy.pd.relay`) and what each API does to a decoder's stream.

A :class:`Transform` is chosen once per stream (:meth:`pdproxy.pd.relay.StreamRelay.transforms`): the chat and
text completions ones are in :mod:`pdproxy.apis.chat`, the Responses and Messages streams in
:mod:`pdproxy.apis.streams`.  The relay calls it only for blocks holding its ``trigger`` (one ``bytes.find`` per
block), so a plain token event costs no Python call of the transform.
"""

from __future__ import annotations

from typing import Protocol


class Transform(Protocol):
    """What the relay's splice reads of a stream transform.

    - ``trigger``: the bytes a block must contain for :meth:`feed` to see it (``b""``: every block);
    - ``recomputed``: True once the client's part of the stream is over and the director must continue the
      request elsewhere (vLLM-Ascend's ``stop_reason "recomputed"``; later blocks then give ``b""``);
    - :meth:`feed`: a block of complete SSE events from the decoder in (``prev``: the block written before it),
      the bytes for the client out (may be empty);
    - :meth:`ending`: the block that holds the stream's end event (the relay's ``done_event``), after
      :meth:`feed`, before it is written as the response's last piece (most transforms return it as is).
    """

    @property
    def trigger(self) -> bytes: ...

    @property
    def recomputed(self) -> bool: ...

    def feed(self, block: bytes, prev: bytes) -> bytes: ...

    def ending(self, block: bytes, prev: bytes) -> bytes: ...
