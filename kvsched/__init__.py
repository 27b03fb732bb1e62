"""kvsched: a KV-cache-centric control plane for LLM serving.

`kvsched.core` is the pure scheduling library (no I/O, no clocks), `kvsched.sim` drives it on a
virtual clock to replay real traces.
"""

__version__ = "0.1.0"
