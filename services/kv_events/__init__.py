"""KV events: today vLLM's KV-event wire format and the Conductor API's KvEvent messages; the
home the KV-event delivery protocol moves into."""
