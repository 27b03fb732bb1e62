"""The KV data plane: today the engines' KV memory layout, its blocks' names and hashes and KV
transfers; the home the rest of the KV data plane moves into."""
