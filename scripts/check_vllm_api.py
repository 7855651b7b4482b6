"""Check the connector against a vLLM source tree's KV connector base class (imports no vLLM).

    python scripts/check_vllm_api.py /path/to/vllm     # a checkout, site-packages, or the vllm package

Lists every method and property of KVConnectorBase_V1 and what KVStoreConnector does about
it; exits 1 when an abstract method is not implemented or a hook is neither implemented
nor decided in kvstore_connector.connector.INHERITED_HOOKS. See kvstore_connector.api_check.
"""

from __future__ import annotations

import sys
from pathlib import Path

# runnable from a checkout without installing: the connector package lives in connector/
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "connector"))

from kvstore_connector.api_check import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
