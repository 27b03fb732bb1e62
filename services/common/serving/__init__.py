"""What every service process runs on: its process, flags, logs, gRPC and HTTP servers, error
answers, health."""
