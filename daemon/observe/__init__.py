"""Seeing the daemon from outside: Prometheus metrics and failure hooks."""
