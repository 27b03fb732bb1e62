"""The vLLM-compatible simulated engine."""
