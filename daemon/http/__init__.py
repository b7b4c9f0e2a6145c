"""The HTTP side of the daemon: `/metrics` for Prometheus and the dashboard."""
