"""The Conductor: owns the cluster view, makes every placement, persists to etcd, runs HA."""
