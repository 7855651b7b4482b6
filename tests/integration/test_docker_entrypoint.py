"""docker/entrypoint-server.sh run for real: it maps the environment to flags and execs
kvstore-server, whose health the image's own HEALTHCHECK command then asks. The files
themselves are linted in tests/unit/test_docker_files.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support.daemon import stop_daemon
from support.dockerfiles import (
    BIN,
    COMPOSE,
    ENTRYPOINT,
    SERVER_DOCKERFILE,
    flag,
    healthcheck_of,
    instructions,
)


def daemon_help_lists_insecure() -> bool:
    out = subprocess.run(
        [str(BIN / "kvstore-server"), "--help"], capture_output=True, text=True, check=True
    ).stdout
    return re.search(r"(^|\s)--insecure([\s,=]|$)", out, re.M) is not None


@pytest.fixture
def entrypoint_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    # the image's PATH has kvstore-server first; here the test environment's does
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["KVSTORE_DATA_DIR"] = str(tmp_path / "data")
    env["KVSTORE_LISTEN"] = "127.0.0.1:0"
    env["KVSTORE_MEMORY"] = "16MiB"
    return env


class Entrypoint:
    def __init__(self, env: dict[str, str], args: list[str], log: Path) -> None:
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [str(ENTRYPOINT), *args], env=env, stdout=subprocess.PIPE, stderr=err, text=True
            )
        self.log = log
        assert self.proc.stdout is not None
        self.ready = self.proc.stdout.readline().strip()  # the daemon's ready line is the synchronisation
        if not self.ready.startswith("kvstore-server ready on "):
            self.stop(signal.SIGKILL)
            raise AssertionError(f"no ready line: {self.ready!r}\n{log.read_text()}")
        self.address = self.ready.split()[3]

    def argv(self) -> list[str]:
        # the entrypoint exec's the daemon: same process, the daemon's arguments
        return Path(f"/proc/{self.proc.pid}/cmdline").read_bytes().decode().split("\0")[:-1]

    def stop(self, sig: int = signal.SIGTERM) -> int:
        return stop_daemon(self.proc, sig)


@pytest.fixture
def run_entrypoint(tmp_path: Path) -> Iterator:
    started: list[Entrypoint] = []

    def run(env: dict[str, str], *args: str) -> Entrypoint:
        # the arena in the test's directory, never the host's /dev/shm
        args = ("--memory-dir", str(tmp_path / "shm"), *args)
        e = Entrypoint(env, list(args), tmp_path / f"entrypoint-{len(started)}.log")
        started.append(e)
        return e

    yield run
    for e in started:
        e.stop(signal.SIGKILL)


def run_check(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A healthcheck command as Docker runs it: `sh -c`, in the container's environment."""
    return subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads the daemon's arguments from /proc")
@pytest.mark.parametrize("insecure", [None, "1"])
def test_entrypoint_runs_the_daemon(
    entrypoint_env, run_entrypoint, tmp_path: Path, insecure: str | None
) -> None:
    env = {**entrypoint_env, "KVSTORE_CAPACITY": "64MiB", "KVSTORE_BACKEND": "disk"}
    if insecure is not None:
        env["KVSTORE_INSECURE"] = insecure
    e = run_entrypoint(env)
    assert e.ready.startswith("kvstore-server ready on 127.0.0.1:")
    assert f"data_dir={tmp_path / 'data'}" in e.ready
    assert "backend=disk" in e.ready and "capacity=64.0 MiB" in e.ready and "memory=16.0 MiB" in e.ready
    argv = e.argv()
    assert Path(argv[1]).name == "kvstore-server", argv  # exec'd: the daemon is the container's PID 1
    # --insecure exactly when asked for and the daemon knows the flag
    assert ("--insecure" in argv) == (insecure == "1" and daemon_help_lists_insecure()), argv

    # the image's HEALTHCHECK and compose's, run as Docker would, see SERVING
    port = e.address.rpartition(":")[2]
    check_env = {**env, "KVSTORE_LISTEN": f"0.0.0.0:{port}"}
    image_check = healthcheck_of(instructions(SERVER_DOCKERFILE))
    compose_test = yaml.safe_load(COMPOSE.read_text())["services"]["kvstore"]["healthcheck"]["test"]
    assert compose_test[0] == "CMD-SHELL"
    compose_check = compose_test[1].replace("$$", "$")
    for command in (image_check, compose_check):
        proc = run_check(command, check_env)
        assert (proc.returncode, proc.stdout.strip()) == (0, "SERVING"), proc.stderr

    assert e.stop(signal.SIGTERM) == 0, e.log.read_text()
    # a daemon that is gone is "unhealthy" (exit 1), not the exit 2 Docker reserves
    for command in (image_check, compose_check):
        assert run_check(command, check_env).returncode == 1


def test_entrypoint_container_arguments_override_the_environment(entrypoint_env, run_entrypoint) -> None:
    env = {**entrypoint_env, "KVSTORE_CAPACITY": "64MiB", "KVSTORE_BACKEND": "disk"}
    e = run_entrypoint(env, "--capacity", "32MiB", "--backend", "lmdb")
    assert "backend=lmdb" in e.ready and "capacity=32.0 MiB" in e.ready, e.ready
    assert e.stop(signal.SIGTERM) == 0


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads the daemon's arguments from /proc")
def test_entrypoint_passes_the_fleet_settings(entrypoint_env, run_entrypoint) -> None:
    # nothing listens there: the daemon starts anyway (the fleet is a miss until it answers)
    env = {**entrypoint_env, "KVSTORE_FLEET": "redis://127.0.0.1:1", "KVSTORE_FLEET_PREFIX": "prod/"}
    e = run_entrypoint(env)
    argv = e.argv()
    assert flag(argv, "--fleet") == "redis://127.0.0.1:1" and flag(argv, "--fleet-prefix") == "prod/", argv
    assert e.stop(signal.SIGTERM) == 0


def test_entrypoint_reports_a_bad_setting(entrypoint_env) -> None:
    proc = subprocess.run(
        [str(ENTRYPOINT)], env={**entrypoint_env, "KVSTORE_CAPACITY": "lots"}, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "lots" in proc.stderr
