"""The process: the ASGI/control application, its state, admin API, passthrough routes and shutdown."""
