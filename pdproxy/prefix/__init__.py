"""Prefix-cache knowledge: vLLM's KV events, their subscriber, the block index and the prefix-aware routing seam."""
