"""Fixture workflows, one module per suite that runs them; every class name is distinct.

A test daemon imports these by module path ("tests.workflows.control"), so a module here must
import nothing from a test file.
"""
