"""End-to-end tests: real workflowd and workflowctl processes."""
