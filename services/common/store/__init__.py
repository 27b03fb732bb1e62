"""The key-value store the Conductor codes against: its interface, over etcd and in memory."""
