"""Whether a request fits: prompt counting, the max_model_len / KV-pool bounds, admission control."""
