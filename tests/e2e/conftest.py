from __future__ import annotations

import random
from pathlib import Path

import pytest
from harness import build_model, run_engines

PROMPT_LENGTHS = (100, 200, 64, 300)


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def model(e2e_dir: Path) -> Path:
    """The 2-layer random Llama every e2e test serves."""
    return build_model(e2e_dir / "model-a", seed=0)


@pytest.fixture(scope="session")
def other_model(e2e_dir: Path) -> Path:
    """Same architecture, different random weights."""
    return build_model(e2e_dir / "model-b", seed=1)


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(512) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="session")
def baseline(e2e_dir: Path, model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens without any connector: what every connector run must reproduce."""
    out = run_engines(e2e_dir, model, [{"name": "base", "kv": None, "prompts": prompts, "max_tokens": 8}])
    return out["base"]["tokens"]
