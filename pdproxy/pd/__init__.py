"""The P→D request path: the director, the prefill and decode legs, the relay, fan-out and the release leg."""
