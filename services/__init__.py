"""Networked services of kvsched: the Conductor, the engine agents and what they share."""
