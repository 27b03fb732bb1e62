"""The Messenger: one per node; relays its engines' KV events and executes KV transfers."""
