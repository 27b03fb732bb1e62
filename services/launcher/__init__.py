"""`kvsched up`: a whole local cluster (etcd, Conductors, Messengers, engines, Routers) on
loopback, one process each, started in dependency order and stopped cleanly."""
