"""kvstore-proxy in front of real vLLM OpenAI servers (CPU) sharing KV through a real daemon.

Two `vllm serve` processes (prefill: kv_producer, decode: kv_consumer) serve a
random tiny Llama with a word-level tokenizer built here ("t0".."t511", one
token per word), so text prompts map to known token ids. Requests go through
the proxy; their tokens must equal a no-connector baseline engine's, and the
store's counters must show the prefill's blocks written and then read by the
decode. The tests without the e2e marker run the proxy alone, against scripted
backends (or none).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from harness import build_model, kv_config, run_engines
from kvstore_connector.config import NamespaceInfo
from servers import (
    BLOCK,
    READY_TIMEOUT,
    REQUEST_TIMEOUT,
    VOCAB,
    Proxy,
    VllmServer,
    build_tokenizer,
    free_port,
    get,
    post,
    start_proxy,
    stop_process,
    text,
)
from support.daemon import Daemon, eventually

from kvstore_client import KVStoreClient

ROOT = Path(__file__).resolve().parents[2]
# Prompt lengths: 7 full blocks (the decode loads 6: one token is always computed), then 4 and 3.
LENGTHS = {"completion": 224, "stream": 150, "chat": 100, "turn": 200}
SKIP_BELOW = 64  # the store-aware proxy skips a prefill when fewer prompt tokens are missing
NEXT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]  # a next turn's tokens
ADMIN_KEY = "admin-key-for-tests"

needs_proxy_deps = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "httpx")),
    reason="the proxy needs fastapi, uvicorn and httpx (vLLM's dependencies)",
)


# ---- processes --------------------------------------------------------------------------
# ---- model and requests -----------------------------------------------------------------
def stats(address: str) -> dict:
    with KVStoreClient(address) as kv:
        return kv.stats()


def logged_max_tokens(server: VllmServer, request_id: str) -> list[int]:
    """max_tokens of each request vLLM logged (--enable-log-requests) under this X-Request-Id."""
    pattern = (
        rf"Received request \S*{re.escape(request_id)}\S*: params: SamplingParams\(.*?\bmax_tokens=(\d+)"
    )
    return [int(m) for m in re.findall(pattern, server.log.read_text(errors="replace"))]


# ---- the P/D stack ----------------------------------------------------------------------
@dataclass
class Stack:
    model: Path
    store: Daemon
    prefill: VllmServer
    decode: VllmServer
    proxy: Proxy
    smart: Proxy  # asks the store first (skips prefills below SKIP_BELOW)
    prompts: dict[str, list[int]]
    baseline: dict[str, list[int]]
    tmp: Path

    def body(self, kind: str, **extra: object) -> dict:
        common = {"model": str(self.model), "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                  "return_token_ids": True, **extra}  # fmt: skip
        if kind == "chat":
            return {"messages": [{"role": "user", "content": text(self.prompts[kind])}], **common}
        return {"prompt": text(self.prompts[kind]), **common}


def cpu_binds() -> tuple[dict[str, str], dict[str, str]]:
    """Half the cores each for prefill and decode when there are two or more (they run at once)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return {}, {}
    half = len(cores) // 2
    bind = "VLLM_CPU_OMP_THREADS_BIND"  # a CPU list such as "0,2" (vLLM's parse_id_list)
    return {bind: ",".join(map(str, cores[:half]))}, {bind: ",".join(map(str, cores[half:]))}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("proxy")
    model = build_model(tmp / "model", seed=0)
    build_tokenizer(model)
    rng = random.Random(4321)
    prompts = {kind: [rng.randrange(VOCAB) for _ in range(n)] for kind, n in LENGTHS.items()}
    prompts["next"] = prompts["turn"] + NEXT  # the same conversation, a few tokens on

    store = Daemon(tmp / "data", capacity="1GiB").start()
    prefill_bind, decode_bind = cpu_binds()
    prefill = VllmServer("prefill", model, kv_config(store.address, "kv_producer"), tmp / "prefill.log",
                         prefill_bind)  # fmt: skip
    decode = VllmServer("decode", model, kv_config(store.address, "kv_consumer"), tmp / "decode.log",
                        decode_bind)  # fmt: skip
    proxy: Proxy | None = None
    smart: Proxy | None = None
    try:
        prefill.start()
        decode.start()
        # the baseline engine (no connector, token-id prompts) runs while the servers start
        names = list(prompts)
        out = run_engines(tmp, model, [{"name": "base", "kv": None, "prompts": [prompts[k] for k in names],
                                        "max_tokens": 8}])  # fmt: skip
        baseline = dict(zip(names, out["base"]["tokens"], strict=True))
        deadline = time.monotonic() + READY_TIMEOUT
        prefill.wait_ready(deadline)
        decode.wait_ready(deadline)
        proxy = Proxy(tmp / "proxy.log", [prefill.url], [decode.url], model=str(model))
        namespace = NamespaceInfo(str(model), "bfloat16", BLOCK, 2, 64, False, "cpu", tp_size=1, pp_size=1)
        smart = Proxy(tmp / "proxy-smart.log", [prefill.url], [decode.url], model=str(model),
                      args=("--store", store.address, "--kv-namespace", namespace.namespace(0).decode(),
                            "--skip-prefill-below", str(SKIP_BELOW),
                            # a late answer prefills (test_proxy_store); here the store must answer
                            "--store-timeout", "30"))  # fmt: skip
        yield Stack(model, store, prefill, decode, proxy, smart, prompts, baseline, tmp)
    finally:
        for p in (proxy, smart):
            if p is not None:
                p.stop()
        prefill.stop()
        decode.stop()
        store.stop()


def served_through_the_store(stack: Stack, before: dict, prompt: list[int]) -> None:
    """The prefill wrote the prompt's full blocks; the decode read all but the last token's."""
    after = stats(stack.store.address)
    assert after["blocks_written"] - before["blocks_written"] == len(prompt) // BLOCK
    # the decode answered its lookup from the store's files (same host); the same
    # Lookup reaches the daemon in the background. vLLM may ask again while the
    # request waits for admission (see KVStoreConnector's scheduler side): every
    # lookup found all blocks but the last token's.
    per_lookup = (len(prompt) - 1) // BLOCK
    eventually(lambda: stats(stack.store.address)["hit_blocks"] >= before["hit_blocks"] + per_lookup)
    hits = stats(stack.store.address)["hit_blocks"] - before["hit_blocks"]
    assert hits % per_lookup == 0, f"{hits} hit blocks is not a whole number of lookups of {per_lookup}"


@pytest.mark.e2e
def test_completion_through_the_proxy(stack: Stack) -> None:
    before = stats(stack.store.address)
    status, doc = post(stack.proxy.url + "/v1/completions", stack.body("completion"),
                       headers={"X-Request-Id": "proxy-completion"})  # fmt: skip
    assert status == 200, doc
    choice = doc["choices"][0]
    assert choice["prompt_token_ids"] == stack.prompts["completion"]
    assert choice["token_ids"] == stack.baseline["completion"]
    assert choice["text"].split() == text(stack.baseline["completion"]).split()
    served_through_the_store(stack, before, stack.prompts["completion"])
    # the prefill got one token to make, the decode the client's request
    assert logged_max_tokens(stack.prefill, "proxy-completion") == [1]
    assert logged_max_tokens(stack.decode, "proxy-completion") == [8]


@pytest.mark.e2e
def test_streamed_completion_through_the_proxy(stack: Stack) -> None:
    before = stats(stack.store.address)
    body = json.dumps(stack.body("stream", stream=True)).encode()
    req = urllib.request.Request(stack.proxy.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    tokens: list[int] = []
    events = []
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: ") :])
            if events[-1] != "[DONE]":
                tokens += json.loads(events[-1])["choices"][0]["token_ids"]
    # NOTE: no count of chunks: vLLM merges the deltas a slow reader has not taken
    # yet into one (its output collector), so 8 tokens may come as one event. That
    # the proxy relays each chunk as it arrives is test_proxy_relays_each_event_as_it_comes.
    assert events[-1] == "[DONE]" and len(events) >= 2, events
    assert tokens == stack.baseline["stream"]
    served_through_the_store(stack, before, stack.prompts["stream"])


@pytest.mark.e2e
def test_chat_completion_through_the_proxy(stack: Stack) -> None:
    before = stats(stack.store.address)
    status, doc = post(stack.proxy.url + "/v1/chat/completions", stack.body("chat"))
    assert status == 200, doc
    assert doc["prompt_token_ids"] == stack.prompts["chat"]
    assert doc["choices"][0]["token_ids"] == stack.baseline["chat"]
    served_through_the_store(stack, before, stack.prompts["chat"])


@pytest.mark.e2e
def test_proxy_passes_a_bad_request_back_as_vllm_answered(stack: Stack) -> None:
    status, doc = post(stack.proxy.url + "/v1/completions", stack.body("completion", temperature=-1.0))
    assert status == 400
    assert "temperature" in doc["error"]["message"]
    status, doc = get(stack.proxy.url + "/v1/models")
    assert status == 200 and doc["data"][0]["id"] == str(stack.model)


@pytest.mark.e2e
def test_a_prompt_the_store_mostly_holds_skips_the_prefill(stack: Stack) -> None:
    before = stack.smart.status()
    # the first turn: nothing stored, so prefill then decode
    status, doc = post(
        stack.smart.url + "/v1/completions", stack.body("turn"), headers={"X-Request-Id": "turn-1"}
    )
    assert status == 200 and doc["choices"][0]["token_ids"] == stack.baseline["turn"], doc
    assert logged_max_tokens(stack.prefill, "turn-1") == [1]
    # a few tokens on: the store holds all but 28 of them (< SKIP_BELOW): straight to decode,
    # which loads the stored blocks and computes the rest
    hits = stats(stack.store.address)["hit_blocks"]
    status, doc = post(
        stack.smart.url + "/v1/completions", stack.body("next"), headers={"X-Request-Id": "turn-2"}
    )
    assert status == 200 and doc["choices"][0]["token_ids"] == stack.baseline["next"], doc
    assert logged_max_tokens(stack.prefill, "turn-2") == []  # no prefill
    assert logged_max_tokens(stack.decode, "turn-2") == [8]
    eventually(lambda: stats(stack.store.address)["hit_blocks"] >= hits + len(stack.prompts["turn"]) // BLOCK)
    after = stack.smart.status()
    assert after["skipped_prefills"] - before["skipped_prefills"] == 1
    assert after["store_lookups"] - before["store_lookups"] == 2 and after["store"]["up"]
    # the proxy's own lookups are probes: counted apart, never as the decode's hits
    assert stats(stack.store.address)["probe_lookups"] >= 2


@pytest.mark.e2e
def test_a_store_that_does_not_answer_makes_the_proxy_prefill_as_before(stack: Stack) -> None:
    namespace = NamespaceInfo(str(stack.model), "bfloat16", BLOCK, 2, 64, False, "cpu", tp_size=1, pp_size=1)
    proxy = Proxy(stack.tmp / "proxy-nostore.log", [stack.prefill.url], [stack.decode.url], model=str(stack.model),
                  args=("--store", f"127.0.0.1:{free_port()}", "--kv-namespace",
                        namespace.namespace(0).decode()))  # fmt: skip
    try:
        status, doc = post(proxy.url + "/v1/completions", stack.body("completion"),
                           headers={"X-Request-Id": "no-store"})  # fmt: skip
        assert status == 200 and doc["choices"][0]["token_ids"] == stack.baseline["completion"], doc
        assert logged_max_tokens(stack.prefill, "no-store") == [1]
        doc = proxy.status()
        assert doc["skipped_prefills"] == 0 and doc["store"]["errors"] == 1 and not doc["store"]["up"]
    finally:
        assert proxy.stop() == 0
    assert proxy.log.read_text().count("store lookup failed") == 1


@pytest.mark.e2e
def test_instances_added_and_removed_with_the_key_and_one_that_fails_goes_out_and_back(stack: Stack) -> None:
    admin = Proxy(stack.tmp / "proxy-admin.log", [stack.prefill.url], [stack.decode.url], model=str(stack.model),
                  env={"ADMIN_API_KEY": ADMIN_KEY})  # fmt: skip
    try:
        _add_remove_fail_and_return(stack, admin)
    finally:
        assert admin.stop() == 0
    assert "back in rotation" in admin.log.read_text()


def _add_remove_fail_and_return(stack: Stack, admin: Proxy) -> None:
    url, key = admin.url, {"X-API-Key": ADMIN_KEY}
    spare = ScriptedBackend(b"", b"", model=str(stack.model))
    add = {"type": "prefill", "instance": spare.url.removeprefix("http://")}
    # the admin routes: off without ADMIN_API_KEY, refused without the key or with a wrong one
    assert post(stack.proxy.url + "/instances/add", add, headers=key)[0] == 403
    assert post(url + "/instances/add", add)[0] == 401
    assert post(url + "/instances/add", add, headers={"X-API-Key": "wrong"})[0] == 401
    # an instance is checked with /v1/models before it is added
    other = ScriptedBackend(b"", b"", model="another-model")
    try:
        status, doc = post(url + "/instances/add", {"type": "decode", "instance": other.url}, headers=key)
        assert status == 400 and "another-model" in doc["error"]["message"], doc
        nobody = f"127.0.0.1:{free_port()}"
        status, doc = post(url + "/instances/add", {"type": "decode", "instance": nobody}, headers=key)
        assert status == 400 and nobody in doc["error"]["message"], doc
    finally:
        other.stop()
    status, doc = post(url + "/instances/add", add, headers=key)
    assert status == 200 and [i["instance"] for i in doc["prefill"]] == [stack.prefill.url, spare.url], doc
    # it goes away: requests move on to the other prefill, and it leaves the rotation
    port = spare.port
    spare.stop()
    for i in range(2):  # round robin: one of the two starts at it
        status, doc = post(
            url + "/v1/completions", stack.body("completion"), headers={"X-Request-Id": f"rr-{i}"}
        )
        assert status == 200 and doc["choices"][0]["token_ids"] == stack.baseline["completion"], doc
    (gone,) = [i for i in admin.status()["prefill"] if i["instance"] == spare.url]
    assert not gone["healthy"] and gone["errors"] == 1 and "ConnectError" in gone["last_error"]
    # it comes back on its port: the proxy's probe puts it back in rotation
    back = ScriptedBackend(b"", b"", model=str(stack.model), port=port)
    try:
        eventually(lambda: all(i["healthy"] for i in admin.status()["prefill"]))
        status, doc = post(url + "/instances/remove", add, headers=key)
        assert status == 200 and [i["instance"] for i in doc["prefill"]] == [stack.prefill.url]
        assert post(url + "/instances/remove", add, headers=key)[0] == 404
    finally:
        back.stop()


# ---- the proxy alone --------------------------------------------------------------------
@needs_proxy_deps
def test_proxy_answers_502_once_no_backend_is_reachable_and_415_without_json(tmp_path: Path) -> None:
    backend = ScriptedBackend(b"", b"")
    proxy = Proxy(tmp_path / "proxy.log", [backend.url], [backend.url])
    try:
        status, doc = get(proxy.url + "/healthz")
        assert status == 200 and doc == {"status": "ok", "prefill": [backend.url], "decode": [backend.url]}
        backend.stop()
        status, doc = post(proxy.url + "/v1/completions", {"model": "m", "prompt": "t1 t2", "max_tokens": 4})
        assert status == 502 and doc["error"]["type"] == "bad_gateway"
        assert f"no prefill backend reachable ({backend.url}: ConnectError" in doc["error"]["message"]
        status, doc = post(proxy.url + "/v1/completions", b"{not json")
        assert status == 400 and "not JSON" in doc["error"]["message"]
        status, doc = post(proxy.url + "/v1/chat/completions", [1, 2])
        assert status == 400 and "JSON object" in doc["error"]["message"]
        status, doc = post(
            proxy.url + "/v1/completions", b"prompt=t1", headers={"Content-Type": "text/plain"}
        )
        assert status == 415 and "application/json" in doc["error"]["message"]
        doc = proxy.status()
        assert doc["requests"] == 1 and doc["errors"] == 1
        assert [(i["instance"], i["healthy"]) for i in doc["prefill"]] == [(backend.url, False)]
    finally:
        assert proxy.stop() == 0


@needs_proxy_deps
def test_proxy_refuses_to_start_without_backends_or_with_one_not_serving_the_model(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFILL_URLS", "DECODE_URLS")}
    proc = subprocess.run([sys.executable, "-m", "kvstore_proxy.main", "--model", "m", "--prefill", "http://p:1"],
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "at least one prefill and one decode URL" in proc.stderr
    serving, other = ScriptedBackend(b"", b""), ScriptedBackend(b"", b"", model="another-model")
    nobody = f"http://127.0.0.1:{free_port()}"
    try:
        proc = start_proxy(tmp_path / "proxy.log", ["--model", "m", "--prefill", serving.url, nobody,
                                                     "--decode", other.url])  # fmt: skip
        try:
            assert proc.wait(timeout=60) == 2  # it checks every instance, then exits by itself
        finally:
            stop_process(proc)
            assert proc.stdout is not None
            proc.stdout.close()
    finally:
        serving.stop()
        other.stop()
    errors = (tmp_path / "proxy.log").read_text()
    assert f"instance {other.url} serves another-model, not m" in errors
    assert f"instance {nobody}/v1/models: ConnectError" in errors
    assert serving.url not in errors


class ScriptedBackend:
    """One HTTP server standing in for both a prefill and a decode instance, for what
    real vLLM cannot be made to do on cue: pause a stream until the client has its
    first event, or break a stream halfway. A request without "stream" gets a
    one-token completion (the prefill's answer); a streamed one gets `first`, then
    waits for `release` (at most RELEASE_WAIT s) and sends `rest`, or with
    `break_after_first` drops the connection mid-body instead. GET /v1/models lists
    `model` (the proxy checks every instance with it)."""

    RELEASE_WAIT = 60.0

    def __init__(self, first: bytes, rest: bytes, break_after_first: bool = False, *, model: str = "m",
                 port: int = 0) -> None:  # fmt: skip
        self.release = threading.Event()
        self.released_in_time: bool | None = None  # set once the stream went on
        backend = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
                pass  # the test's output is the proxy's log, not this server's

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                doc = json.dumps({"object": "list", "data": [{"id": model, "object": "model"}]}).encode()
                self.send_response(200 if self.path == "/v1/models" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(doc)))
                # no keep-alive: a connection left open would outlive stop() (its handler
                # thread serves on), and a stopped backend would still answer
                self.send_header("Connection", "close")
                self.close_connection = True
                self.end_headers()
                self.wfile.write(doc)

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not body.get("stream"):
                    doc = json.dumps({"choices": [{"text": "t1", "token_ids": [1]}]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(doc)))
                    self.end_headers()
                    self.wfile.write(doc)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self._chunk(first)
                if break_after_first:
                    self.close_connection = True  # no closing chunk: the body is cut short
                    return
                backend.released_in_time = backend.release.wait(backend.RELEASE_WAIT)
                self._chunk(rest)
                self.wfile.write(b"0\r\n\r\n")

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def event(doc: object) -> bytes:
    return f"data: {json.dumps(doc)}\n\n".encode()


def streamed_events(url: str, on_first: Callable[[], None] = lambda: None) -> list[str]:
    """POST a streamed completion; the data of each server-sent event, in order."""
    body = json.dumps({"model": "m", "prompt": "t1 t2", "max_tokens": 2, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    events: list[str] = []
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if len(events) == 1:
                    on_first()
    return events


@needs_proxy_deps
def test_proxy_relays_each_event_as_it_comes(tmp_path: Path) -> None:
    """The decode's first event reaches the client while the decode still holds back the
    rest: a proxy that buffered the body would deliver nothing until the backend gave up
    waiting, and `released_in_time` would be False."""
    first = {"choices": [{"text": " t5", "token_ids": [5]}]}
    second = {"choices": [{"text": " t6", "token_ids": [6]}]}
    backend = ScriptedBackend(event(first), event(second) + b"data: [DONE]\n\n")
    proxy = Proxy(tmp_path / "proxy.log", [backend.url], [backend.url])
    try:
        events = streamed_events(proxy.url, on_first=backend.release.set)
    finally:
        assert proxy.stop() == 0
        backend.stop()
    assert backend.released_in_time is True
    assert [json.loads(e) for e in events[:2]] == [first, second] and events[2:] == ["[DONE]"]


@needs_proxy_deps
def test_proxy_ends_a_stream_the_decode_broke_with_an_error_event(tmp_path: Path) -> None:
    first = {"choices": [{"text": " t5", "token_ids": [5]}]}
    backend = ScriptedBackend(event(first), b"", break_after_first=True)
    proxy = Proxy(tmp_path / "proxy.log", [backend.url], [backend.url])
    try:
        events = streamed_events(proxy.url)
    finally:
        assert proxy.stop() == 0
        backend.stop()
    assert json.loads(events[0]) == first and len(events) == 2, events
    error = json.loads(events[1])["error"]
    assert error["code"] == 502 and error["type"] == "bad_gateway"
    assert f"decode backend {backend.url} failed mid-stream" in error["message"]
    assert f"decode {backend.url}: stream broken" in proxy.log.read_text()
