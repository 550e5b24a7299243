"""Operations: Prometheus metrics, the request log, tracing, logging and GC policy."""
