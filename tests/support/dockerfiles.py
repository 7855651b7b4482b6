"""docker/'s files as the tests read them: where they are, a Dockerfile's instructions and
HEALTHCHECK, a flag's value in a command line. Shared by tests/unit/test_docker_files.py
(the files) and tests/integration/test_docker_entrypoint.py (the daemon the entrypoint runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
SERVER_DOCKERFILE = DOCKER / "Dockerfile.server"
VLLM_DOCKERFILE = DOCKER / "Dockerfile.vllm"
ENTRYPOINT = DOCKER / "entrypoint-server.sh"
BIN = Path(sys.executable).parent


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = pending + stripped
        pending = ""
        word, _, rest = text.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, f"{path.name}: ends inside a continuation line"
    return out


def healthcheck_of(ins: list[tuple[str, str]]) -> str:
    """The HEALTHCHECK's command as the shell line it runs."""
    checks = [rest for word, rest in ins if word == "HEALTHCHECK"]
    assert len(checks) == 1, checks
    cmd = checks[0].split(" CMD ", 1)[1].strip()
    if cmd.startswith("["):
        argv = json.loads(cmd)
        assert argv[:2] == ["sh", "-c"], argv
        return str(argv[2])
    return cmd


def flag(command: list[str], name: str) -> str:
    for i, arg in enumerate(command):
        if arg == name:
            return command[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {command}")
