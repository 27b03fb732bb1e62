"""What every service builds on, by capability: `serving` (process, flags, logs, gRPC and HTTP
servers, health), `security`, `store` (the Store interface, etcd and in memory), `telemetry`
and `inference_api` (the inference APIs as vLLM reads them)."""
