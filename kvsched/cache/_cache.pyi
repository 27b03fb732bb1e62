# Types of the compiled simulator cache (_cache.c). Its methods are those of the EngineCache
# protocol (kvsched.sim.cache), declared there once: the type is stated as what it makes.
from collections.abc import Callable

from kvsched.core.events import BlocksRemoved, BlocksStored
from kvsched.sim.cache import EngineCache

Cache: Callable[[int, type[BlocksStored], type[BlocksRemoved]], EngineCache]
