"""kvsched's KV connector for vLLM: loaded by a stock vLLM with `--kv-transfer-config`
(`kv_connector_module_path` `services.vllm_connector.connector`), it saves the blocks vLLM
computes into its node's KV pool and loads the blocks vLLM lacks from it.

Runs inside vLLM's own environment: nothing here imports more than the standard library,
numpy, torch, vLLM and kvsched's pure core, and the pool socket's wire format
(`services.dataplane.pool_wire`, standard library only, through a front door that imports
nothing on its own)."""
