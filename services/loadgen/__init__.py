"""`kvsched bench`: replay a trace slice through live Routers and compare with the simulator."""
