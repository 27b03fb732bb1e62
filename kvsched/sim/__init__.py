"""Trace-replay simulator: engine model, trace readers, virtual-clock replay, metrics, reports."""
