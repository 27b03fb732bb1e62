"""The only place that imports gRPC servers, etcd, OpenTelemetry and settings."""
