"""Maintenance tools: data and models the project makes, run by hand (see each docstring)."""
