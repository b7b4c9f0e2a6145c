"""Runs workflows: actors, arming of waits, recovery, the public API."""
