"""Tests of the simulated vLLM engine (pdproxy/sim) and pdproxy/tokens.py."""
