"""The operator's tools: repairs, reload, graphs."""
