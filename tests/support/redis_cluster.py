"""A real Redis Cluster for the fleet tier's tests: `masters` masters (and `replicas`
replicas each) of Debian's redis-server on free 127.0.0.1 ports, in a temp dir, no
persistence. scripts/test.sh installs redis-server where it is missing.

Start-up is synchronised on what the processes say, never on sleeps: each server's
"Ready to accept connections" line, then `redis-cli --cluster create`, then every
node reporting cluster_state:ok (polled with a deadline: the gossip has no event).
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import redis

from support.daemon import eventually

NOT_INSTALLED = "redis-server is not installed (scripts/test.sh installs it: apt-get install redis-server)"


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port() -> int:
    """A free port whose cluster bus port (10000 above) is free too (so at most 55535)."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 55535)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


@dataclass
class Node:
    port: int
    root: Path
    proc: subprocess.Popen[str] | None = None
    cluster: bool = True  # False: a plain Redis
    settings: list[str] = field(default_factory=list)  # more redis.conf lines

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, exe: str | None = None) -> Node:
        exe = exe or shutil.which("redis-server")
        if exe is None:
            raise RuntimeError(NOT_INSTALLED)
        self.root.mkdir(parents=True, exist_ok=True)
        conf = self.root / "redis.conf"
        settings = [f"port {self.port}", "bind 127.0.0.1", f"dir {self.root}", 'save ""', "appendonly no",
                    'logfile ""', "protected-mode no"]  # fmt: skip
        if self.cluster:
            settings += ["cluster-enabled yes", "cluster-config-file nodes.conf", "cluster-node-timeout 1000"]
        conf.write_text("\n".join([*settings, *self.settings]) + "\n")
        self.proc = subprocess.Popen(
            [exe, str(conf)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert self.proc.stdout is not None
        seen = []
        for line in self.proc.stdout:
            seen.append(line)
            if "Ready to accept connections" in line:
                # keep reading its log, or a full pipe would stop the server
                threading.Thread(target=self._drain, args=(self.proc.stdout,), daemon=True).start()
                return self
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not start:\n{''.join(seen)}")

    def _drain(self, stream: IO[str]) -> None:
        with stream, (self.root / "redis.log").open("a") as log:
            for line in stream:
                log.write(line)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait()  # the drain thread ends at the end of its output
        self.proc = None


@dataclass
class Cluster:
    root: Path
    masters: int = 3
    replicas: int = 0
    nodes: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The fleet URL of this cluster (every master as a start-up node)."""
        return "redis+cluster://" + ",".join(n.address for n in self.nodes[: self.masters])

    def start(self) -> Cluster:
        exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if exe is None or cli is None:
            raise RuntimeError(
                "redis-server is not installed (scripts/test.sh installs it: apt-get install redis-server)"
            )
        count = self.masters * (1 + self.replicas)
        self.nodes = [Node(free_cluster_port(), self.root / f"node{i}") for i in range(count)]
        for node in self.nodes:
            node.start(exe)
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(n.address for n in self.nodes),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],  # fmt: skip
            check=True,
            capture_output=True,
            text=True,
        )
        eventually(self.healthy, deadline_s=30.0)
        return self

    def healthy(self) -> bool:
        for node in self.nodes:
            if node.proc is None:
                continue
            try:
                info = node.client().cluster("info")
            except redis.RedisError:
                return False
            if info.get("cluster_state") != "ok":
                return False
        return True

    def flush(self) -> None:
        """Empty every master (between tests)."""
        for node in self.nodes:
            if node.proc is None:
                continue
            with node.client() as r:
                if r.info("replication").get("role") == "master":
                    r.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
