"""Durable storage: the Store protocol and its SQLite backend."""
