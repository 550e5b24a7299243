"""Operator tools on top of the proxy: doctor, demo and the tiny model used in tests."""
