"""kvstore-proxy: the XpYd prefill/decode proxy, aware of the store.

    kvstore-proxy --model MODEL --prefill http://p1:8100 http://p2:8100 --decode http://d1:8200 \\
        [--store 127.0.0.1:50051 --kv-namespace 'kvc2|MODEL|bfloat16|bs16|...'] [--port 8000]

Each POST /v1/completions or /v1/chat/completions goes first to a prefill instance
(a vLLM with kv_role kv_producer) with max_tokens=1: when it answers, the prompt's
KV is in the store. The request then goes to a decode instance, which loads that KV
instead of computing it. With --store and --kv-namespace, the proxy first asks the
store how much of the prompt it holds (the prompt tokenized by a decode instance's
/tokenize, hashed as the connector does): when fewer than --skip-prefill-below
tokens are missing, the prefill round trip is skipped and the decode computes them.
A store that does not answer makes every request prefill, as without one.

Other routes: GET /status, GET /healthz, GET /v1/models, and POST /instances/add and
/instances/remove ({"type": "prefill"|"decode", "instance": "HOST:PORT"}, with an
X-API-Key header equal to $ADMIN_API_KEY; refused when that is unset).

Needs fastapi, uvicorn and httpx: `pip install 'kvstore[proxy]'` (vLLM has all three).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from types import FrameType

import httpx
import uvicorn

from kvstore_client import KVStoreClient
from kvstore_client.address import with_default_port
from kvstore_proxy.app import Proxy, ProxySettings, create_app, served_models
from kvstore_proxy.instances import POLICIES, normalize_url
from kvstore_proxy.store import StoreTarget, StoreView

log = logging.getLogger("kvstore-proxy")


class _Server(uvicorn.Server):
    """Prints one ready line, with the bound port, once it accepts connections."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            print(f"kvstore-proxy ready on {host}:{port}", flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process would
        # die of it; a requested stop is a clean exit here (0), as for kvstore-server.
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


def _urls(values: list[list[str]] | None, env: str) -> list[str]:
    items = [v for group in values or [] for v in group] or [os.environ.get(env, "")]
    return [normalize_url(part) for item in items for part in item.split(",") if part.strip()]


def parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="kvstore-proxy", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=env("PROXY_MODEL"), help="the model every instance must serve (env PROXY_MODEL)"
    )
    p.add_argument("--prefill", nargs="+", action="append", metavar="URL",
                   help="prefill instances (X); env PREFILL_URLS, comma-separated")  # fmt: skip
    p.add_argument("--decode", nargs="+", action="append", metavar="URL",
                   help="decode instances (Y); env DECODE_URLS, comma-separated")  # fmt: skip
    p.add_argument("--policy", choices=sorted(POLICIES), default="round_robin", help="default round_robin")
    p.add_argument("--store", default=env("KVSTORE_ADDRESS"), metavar="HOST:PORT",
                   help="the kvstore daemon to ask before a prefill (env KVSTORE_ADDRESS; "
                        "HOST alone: port 50051)")  # fmt: skip
    p.add_argument(
        "--kv-namespace",
        default=env("KVSTORE_NAMESPACE"),
        metavar="NAMESPACE",
        help="the decode connector's namespace, as its log prints it (env KVSTORE_NAMESPACE)",
    )
    p.add_argument(
        "--skip-prefill-below",
        type=int,
        default=256,
        metavar="N",
        help="skip the prefill when fewer than N prompt tokens are not stored (256; 0: never)",
    )
    p.add_argument("--store-timeout", type=float, default=0.2, help="seconds a store lookup may take (0.2)")
    p.add_argument("--host", default=env("PROXY_HOST", "0.0.0.0"), help="address to listen on (0.0.0.0)")
    p.add_argument(
        "--port", type=int, default=int(env("PROXY_PORT", "8000")), help="default 8000; 0: any free"
    )
    p.add_argument("--timeout", type=float, default=float(env("PROXY_TIMEOUT", "600")),
                   help="seconds a backend may take to answer (600)")  # fmt: skip
    p.add_argument("--probe-interval", type=float, default=5.0,
                   help="seconds between probes of an instance out of rotation (5)")  # fmt: skip
    p.add_argument("--log-level", default=env("PROXY_LOG_LEVEL", "info"), help="default info")
    return p


async def _check_all(model: str, urls: list[str]) -> list[str]:
    """Why each instance that does not serve `model` cannot."""
    async with httpx.AsyncClient() as client:
        answers = await asyncio.gather(*(served_models(client, u) for u in urls), return_exceptions=True)
    problems = []
    for url, got in zip(urls, answers, strict=True):
        if isinstance(got, BaseException):
            problems.append(str(got))  # names the instance
        elif model not in got:
            problems.append(f"{url} serves {', '.join(got) or 'no model'}, not {model}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        prefill = _urls(args.prefill, "PREFILL_URLS")
        decode = _urls(args.decode, "DECODE_URLS")
    except ValueError as exc:
        p.error(str(exc))
    if not prefill or not decode:
        p.error(
            "give at least one prefill and one decode URL (--prefill/--decode or PREFILL_URLS/DECODE_URLS)"
        )
    if not args.model:
        p.error("--model is required: every instance must serve it")
    if args.timeout <= 0 or args.store_timeout <= 0 or args.probe_interval <= 0:
        p.error("--timeout, --store-timeout and --probe-interval must be positive")
    if args.skip_prefill_below < 0:
        p.error("--skip-prefill-below must be 0 or more")
    if bool(args.store) != bool(args.kv_namespace):
        p.error("--store and --kv-namespace go together (prompts are hashed under the connector's namespace)")
    if args.store:
        try:
            args.store = with_default_port(args.store)  # the daemon's port, not gRPC's 443
        except ValueError as exc:
            p.error(f"--store: {exc}")
    target = None
    if args.kv_namespace:
        try:
            target = StoreTarget(args.kv_namespace)
        except ValueError as exc:
            p.error(str(exc))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per backend call is too many

    problems = asyncio.run(_check_all(args.model, prefill + decode))
    if problems:
        for problem in problems:
            print(f"kvstore-proxy: instance {problem}", file=sys.stderr)
        return 2
    store = None
    if target is not None:
        store = StoreView(
            KVStoreClient(
                args.store, arena=False, local_reads=False, token=os.environ.get("KVSTORE_TOKEN") or None
            ),
            target,
            timeout_s=args.store_timeout,
        )
        store.connect(timeout_s=max(args.store_timeout, 2.0))
    settings = ProxySettings(
        model=args.model,
        timeout_s=args.timeout,
        skip_prefill_below=args.skip_prefill_below,
        probe_interval_s=args.probe_interval,
    )
    app = create_app(Proxy(settings, prefill, decode, POLICIES[args.policy], store))

    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        print(f"kvstore-proxy: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    log.info("model %s; prefill %s; decode %s; store %s", args.model, ", ".join(prefill), ", ".join(decode),
             f"{args.store} ({target.namespace})" if target else "none")  # fmt: skip
    server = _Server(uvicorn.Config(app, log_level=args.log_level.lower(), timeout_graceful_shutdown=30))
    server.run(sockets=[sock])
    return 0 if server.started else 3


if __name__ == "__main__":
    sys.exit(main())
