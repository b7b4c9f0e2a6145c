"""The engine and its DSL: pure, no I/O."""
