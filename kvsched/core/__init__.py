"""Pure scheduling core.

Nothing here reads a clock, touches the network or uses module-level randomness: callers pass
`now` (seconds on whatever clock they run) and a seeded `random.Random`. The simulator and the
live Conductor build these objects through `kvsched.core.cluster.build_cluster`.
"""
