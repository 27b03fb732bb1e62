"""Client libraries for the kvsched Conductor: `clients.python` (asyncio, grpc.aio) and, outside
Python, `clients/node`."""
