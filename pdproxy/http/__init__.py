"""Bytes on sockets, nothing about PD: pdproxy's HTTP/1.x server, the engine-side client and its error tree, SSE framing, TLS."""
