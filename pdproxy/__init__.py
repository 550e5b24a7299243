"""pdproxy: PD-disaggregation load-balancing proxy for vLLM / vLLM-Ascend."""

__version__ = "0.1.0"
