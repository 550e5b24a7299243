"""What a request and its answer look like on the wire: request shapes, stream transforms, the vLLM P→D contract (kv_transfer)."""
