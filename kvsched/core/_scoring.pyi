# Types of the compiled scoring kernels (_scoring.c). Its functions are the methods of the
# Kernels protocol (kvsched.core.scoring), declared there once: each is typed as that method.
from kvsched.core.scoring import Kernels

_kernels: Kernels  # a name for typing only; the module has no such attribute
ttft = _kernels.ttft
moving = _kernels.moving
fetch_when_cheaper = _kernels.fetch_when_cheaper
fetch_from = _kernels.fetch_from
candidates = _kernels.candidates
cold_score = _kernels.cold_score
best_slot = _kernels.best_slot
masked_min = _kernels.masked_min
argmin = _kernels.argmin
hit_vectors = _kernels.hit_vectors
pool_load = _kernels.pool_load
