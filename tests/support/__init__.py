"""Helpers shared by the test suites and the benches (tests/ is on sys.path through pytest's
`pythonpath` in pyproject.toml, and bench/_paths.py for the benches)."""
