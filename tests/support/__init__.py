"""Helpers shared by the test suites (on sys.path through tests/conftest.py)."""
