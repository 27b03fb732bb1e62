# Types of the compiled simulator cache (_cache.c). Its methods are those of the EngineCache
# protocol (kvsched.cache.prefix_cache), declared there once: the type is stated as what it makes.
from collections.abc import Callable

from kvsched.cache.prefix_cache import EngineCache
from kvsched.core.events import BlocksRemoved, BlocksStored

Cache: Callable[[int, type[BlocksStored], type[BlocksRemoved]], EngineCache]
