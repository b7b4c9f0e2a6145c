"""workflowd: durable workflows written as Python code."""
