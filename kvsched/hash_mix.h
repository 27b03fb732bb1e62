/* The mixing step of the compiled hash tables (kvsched/core/_holdings.c, kvsched/sim/_cache.c):
   splitmix64's finalizer. Test hashes are small integers, real ones already random; either way
   every bit of the key reaches the low bits a table index keeps. */
#ifndef KVSCHED_HASH_MIX_H
#define KVSCHED_HASH_MIX_H

#include <stdint.h>

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

#endif
