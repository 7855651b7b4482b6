"""A small OpenAI-compatible proxy for prefill/decode (P/D) disaggregated serving through kvstore.

    python proxy.py --prefill http://prefill:8100 --decode http://decode:8200 [--port 8000]

Each POST /v1/completions or /v1/chat/completions goes first to a prefill
instance (a vLLM with kv_role kv_producer) with max_tokens=1 and stream=false;
when it answers, the prompt's KV is in the store. The original request then
goes to a decode instance (kv_consumer), which loads that KV instead of
recomputing it; its answer is returned as it is, streamed through when the
request has "stream": true. Nothing else travels between the two: kvstore finds
the KV by the prompt's block hashes.

Several instances: comma-separated URLs (or the flag repeated) are used round
robin; an instance that refuses the connection is skipped for the next one.
A backend that fails (unreachable, timed out, a 5xx) gets the client a 502
with a message naming it; a 4xx (a bad request) comes back as the backend
sent it.

Other routes: GET /healthz (the proxy itself: 200 and its backends),
GET /v1/models (from a decode instance).

Settings, flag or environment: --prefill/PREFILL_URLS, --decode/DECODE_URLS,
--host/PROXY_HOST (0.0.0.0), --port/PROXY_PORT (8000; 0 picks a free one),
--timeout/PROXY_TIMEOUT (seconds a backend may take to answer; 600).
Prints `kvstore-proxy ready on HOST:PORT` when it serves.

Needs fastapi, uvicorn and httpx: all three are in vLLM's images and environments.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("kvstore-proxy")

# Request headers worth passing on to the backends (vLLM's --api-key, tracing).
FORWARD_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")
# Fields a prefill-only request must not keep: it makes one token and no stream.
PREFILL_DROP = ("stream", "stream_options", "min_tokens")


class BackendError(Exception):
    """A backend could not give an answer: the client gets a 502 with this message."""


class Pool:
    """Instances of one role, taken round robin."""

    def __init__(self, role: str, urls: list[str]) -> None:
        if not urls:
            raise ValueError(f"no {role} URLs given")
        self.role = role
        self.urls = urls
        self._start = itertools.cycle(range(len(urls)))

    def order(self) -> list[str]:
        """Every instance, starting with the next one in turn (the rest are fallbacks)."""
        i = next(self._start)
        return self.urls[i:] + self.urls[:i]


def parse_urls(values: list[str]) -> list[str]:
    urls = []
    for value in values:
        for part in value.split(","):
            part = part.strip().rstrip("/")
            if not part:
                continue
            if "://" not in part:
                part = "http://" + part
            urls.append(part)
    return urls


def prefill_request(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The request a prefill instance gets: same prompt and settings, one token, no stream."""
    req = copy.deepcopy(body)
    for key in PREFILL_DROP:
        req.pop(key, None)
    req["max_tokens"] = 1
    if chat:
        req["max_completion_tokens"] = 1
    if "n" in req:
        req["n"] = 1
    return req


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    """An error in the OpenAI shape."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _excerpt(content: bytes, limit: int = 500) -> str:
    text = content.decode("utf-8", "replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout: float) -> None:
        self.prefill = Pool("prefill", prefill)
        self.decode = Pool("decode", decode)
        self.timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        self.client: httpx.AsyncClient | None = None

    async def open(self) -> None:
        self.client = httpx.AsyncClient(
            timeout=self.timeout, limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        )

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def send(self, pool: Pool, method: str, path: str, *, body: Any = None,
                   headers: dict[str, str], stream: bool = False) -> tuple[str, httpx.Response]:  # fmt: skip
        """Send to the next instance of `pool`, moving on to the others while connections are refused."""
        assert self.client is not None
        failures = []
        for url in pool.order():
            request = self.client.build_request(method, url + path, json=body, headers=headers)
            try:
                return url, await self.client.send(request, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                log.warning("%s %s: cannot connect: %s", pool.role, url, _describe(exc))
                failures.append(f"{url}: {_describe(exc)}")
            except httpx.HTTPError as exc:
                raise BackendError(f"{pool.role} backend {url} failed: {_describe(exc)}") from exc
        raise BackendError(f"no {pool.role} backend reachable ({'; '.join(failures)})")


def _headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}


def _passthrough(response: httpx.Response, content: bytes) -> Response:
    media = response.headers.get("content-type", "application/json")
    return Response(content=content, status_code=response.status_code, media_type=media)


def create_app(proxy: Proxy) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.open()
        try:
            yield
        finally:
            await proxy.close()

    app = FastAPI(title="kvstore P/D proxy", lifespan=lifespan)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "prefill": proxy.prefill.urls, "decode": proxy.decode.urls}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            url, response = await proxy.send(proxy.decode, "GET", "/v1/models", headers=_headers(request))
        except BackendError as exc:
            return error_response(502, str(exc), "bad_gateway")
        return _passthrough(response, response.content)

    async def generate(request: Request, path: str, chat: bool) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return error_response(400, f"request body is not JSON: {exc}", "invalid_request_error")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object", "invalid_request_error")
        headers = _headers(request)

        # 1. prefill: the prompt's KV goes to the store; its one token is dropped.
        try:
            url, response = await proxy.send(
                proxy.prefill, "POST", path, body=prefill_request(body, chat), headers=headers
            )
        except BackendError as exc:
            return error_response(502, str(exc), "bad_gateway")
        if response.status_code >= 500:
            return error_response(
                502,
                f"prefill backend {url} answered {response.status_code}: {_excerpt(response.content)}",
                "bad_gateway",
            )
        if response.status_code >= 400:  # the request itself is bad: say so as vLLM did
            return _passthrough(response, response.content)

        # 2. decode: the original request; the decode instance loads the prompt's KV from the store.
        stream = bool(body.get("stream"))
        try:
            url, response = await proxy.send(
                proxy.decode, "POST", path, body=body, headers=headers, stream=stream
            )
        except BackendError as exc:
            return error_response(502, str(exc), "bad_gateway")
        if response.status_code >= 400 or not stream:
            try:
                content = await response.aread()
            except httpx.HTTPError as exc:
                return error_response(502, f"decode backend {url} failed: {_describe(exc)}", "bad_gateway")
            finally:
                await response.aclose()
            if response.status_code >= 500:
                return error_response(
                    502,
                    f"decode backend {url} answered {response.status_code}: {_excerpt(content)}",
                    "bad_gateway",
                )
            return _passthrough(response, content)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:
                # The status line is sent already: end the stream with an error event, as vLLM does.
                log.warning("decode %s: stream broken: %s", url, _describe(exc))
                message = f"decode backend {url} failed mid-stream: {_describe(exc)}"
                event = {"error": {"message": message, "type": "bad_gateway", "code": 502}}
                yield f"data: {json.dumps(event)}\n\n".encode()
            finally:
                await response.aclose()

        media = response.headers.get("content-type", "text/event-stream")
        return StreamingResponse(relay(), status_code=response.status_code, media_type=media)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "/v1/chat/completions", chat=True)

    return app


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


def _parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="kvstore-proxy", description="P/D proxy: prefill (max_tokens=1), then decode."
    )
    p.add_argument("--prefill", action="append", help="prefill URL(s), comma-separated; env PREFILL_URLS")
    p.add_argument("--decode", action="append", help="decode URL(s), comma-separated; env DECODE_URLS")
    p.add_argument(
        "--host", default=env("PROXY_HOST", "0.0.0.0"), help="address to listen on (default 0.0.0.0)"
    )
    p.add_argument(
        "--port", type=int, default=int(env("PROXY_PORT", "8000")), help="default 8000; 0: any free"
    )
    p.add_argument(
        "--timeout", type=float, default=float(env("PROXY_TIMEOUT", "600")), help="backend timeout, s (600)"
    )
    p.add_argument("--log-level", default=env("PROXY_LOG_LEVEL", "info"), help="default info")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    prefill = parse_urls(args.prefill or [os.environ.get("PREFILL_URLS", "")])
    decode = parse_urls(args.decode or [os.environ.get("DECODE_URLS", "")])
    if not prefill or not decode:
        parser.error(
            "give at least one prefill and one decode URL (--prefill/--decode or PREFILL_URLS/DECODE_URLS)"
        )
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per backend call is too many
    app = create_app(Proxy(prefill, decode, args.timeout))

    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        print(f"kvstore-proxy: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    log.info("prefill %s; decode %s", ", ".join(prefill), ", ".join(decode))
    server = _Server(uvicorn.Config(app, log_level=args.log_level.lower(), timeout_graceful_shutdown=30))
    server.run(sockets=[sock])
    return 0 if server.started else 3


if __name__ == "__main__":
    sys.exit(main())
