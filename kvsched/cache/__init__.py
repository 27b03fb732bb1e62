"""The prefix KV cache of one engine (`prefix_cache`): pages, cached blocks, locks and LRU
eviction, with the events vLLM's KV events carry. Neither simulator nor service: the
simulator's engines and tiers, the simulated engine service and the Messengers' node KV pools
all build on it."""
