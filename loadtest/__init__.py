"""Benchmarks and load generators for pdproxy (never run as timed tests; see ``loadtest/RESULTS.md``).

- ``python -m loadtest.bench``: the headless overhead benchmark (direct / client-side PD / pdproxy / another
  proxy), one JSON document on stdout;
- ``loadtest/locustfile.py``: SDK-shaped load with TTFT and ITL as custom locust metrics;
- ``loadtest.fake_engine``: a minimal raw-socket vLLM-shaped engine, far cheaper than any proxy;
- ``loadtest.loadgen``: the open-loop / closed-loop load generator (its own process).
"""
