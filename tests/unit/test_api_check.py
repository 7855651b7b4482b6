"""kvstore_connector.api_check: the connector against a vLLM tree's KVConnectorBase_V1, read with ast."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest
from kvstore_connector import api_check


def installed_vllm() -> Path:
    """The installed vLLM's package directory, found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


def test_the_installed_vllm_has_every_hook_implemented_or_decided(capsys: pytest.CaptureFixture[str]) -> None:
    assert api_check.main([str(installed_vllm())]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("OK:")
    # every method and property is listed, with what the connector does about it
    assert "get_num_new_matched_tokens (abstract method)" in out and "implemented" in out
    assert "reset_cache (method)" in out and "inherited: None (not supported)" in out
    # the site-packages directory and base.py itself name the same tree
    assert api_check.find_base(installed_vllm().parent) == api_check.find_base(installed_vllm())


BASE = """
from abc import ABC, abstractmethod

class KVConnectorBase_V1(ABC):
    def __init__(self, vllm_config, role, kv_cache_config):
        self._role = role

    @property
    def role(self):
        return self._role

    def _private_helper(self):
        return None

    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs):
        pass

    @abstractmethod
    def brand_new_abstract(self, request):
        pass

    @classmethod
    def brand_new_hook(cls, kv_transfer_config):
        return True

    def reset_cache(self):
        return None
"""


def test_a_new_abstract_method_and_an_undecided_hook_fail_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "vllm" / api_check.BASE_PATH
    base.parent.mkdir(parents=True)
    base.write_text(textwrap.dedent(BASE))
    assert api_check.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "ERROR: abstract, not implemented by KVStoreConnector" in lines["brand_new_abstract"]
    assert "ERROR: undecided" in lines["brand_new_hook"] and "INHERITED_HOOKS" in lines["brand_new_hook"]
    assert "implemented" in lines["start_load_kv"] and "ERROR" not in lines["start_load_kv"]
    assert lines["reset_cache"].split()[-1] != "ERROR" and "inherited:" in lines["reset_cache"]
    assert "_private_helper" not in out and "__init__" not in out  # not hooks
    assert out.splitlines()[-1] == (
        "FAILED: abstract, not implemented: brand_new_abstract; undecided: brand_new_hook"
    )


def test_a_hook_both_implemented_and_listed_as_inherited_fails(tmp_path: Path) -> None:
    base = tmp_path / "base.py"
    base.write_text(textwrap.dedent(BASE).replace("brand_new", "other"))
    connector = tmp_path / "connector.py"
    connector.write_text(
        textwrap.dedent("""
        INHERITED_HOOKS = {"role": "the base's", "reset_cache": "not supported", "other_hook": "True"}

        class KVStoreConnector(KVConnectorBase_V1):
            def start_load_kv(self, forward_context, **kwargs): ...
            def other_abstract(self, request): ...
            def reset_cache(self): ...
    """)
    )
    report = api_check.check(base, connector)
    assert (report.missing_abstract, report.undecided, report.contradictory) == ([], [], ["reset_cache"])


def test_a_tree_without_the_base_class_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert api_check.main([str(tmp_path)]) == 2
    assert "no vllm/distributed/kv_transfer/kv_connector/v1/base.py under" in capsys.readouterr().err
