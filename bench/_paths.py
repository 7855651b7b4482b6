"""Where a bench run as `python bench/bench_x.py` finds the code it needs: imported by
each bench before its other imports (the one place that edits sys.path).

The repo root and connector/ let a bare checkout (a GPU host, no `pip install -e`) run
the benches; tests/ and tests/e2e/ are what pytest's `pythonpath` (pyproject.toml)
gives the tests: the support package, the integration helpers and the e2e harness.

NOTE: `import _paths` sorts first among a bench's third-party imports (ruff's isort puts
plain imports before `from` ones, and "_" before letters), so it runs before the imports
that need it with no `# noqa: E402` on them.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

for _sub in ("", "connector", "tests/e2e", "tests"):
    _path = str(ROOT / _sub)
    if _path not in sys.path:
        sys.path.insert(0, _path)
