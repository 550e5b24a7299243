"""What pdproxy knows about each engine: the pool, health, breakers, limits, served models, the control-plane client."""
