"""The proxy's HTTP side: OpenAI routes through prefill then decode, status, and the
admin routes that add and remove instances."""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvstore_proxy.instances import ROLES, Instance, Pool, SchedulingPolicy, normalize_url
from kvstore_proxy.store import StoreView

log = logging.getLogger("kvstore-proxy")

# Request headers worth passing on to the backends (vLLM's --api-key, tracing).
FORWARD_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")
# Fields a prefill-only request must not keep: it makes one token and no stream.
PREFILL_DROP = ("stream", "stream_options", "min_tokens")
# Fields of a chat request that shape its prompt, passed on to /tokenize.
CHAT_TOKENIZE = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                 "chat_template", "chat_template_kwargs", "tools")  # fmt: skip
MAX_BODY_BYTES = 64 << 20
TOKENIZE_TIMEOUT_S = 5.0  # a decode that cannot tokenize in time: prefill as usual


class BackendError(Exception):
    """A backend could not give an answer: the client gets a 502 with this message."""


@dataclass
class Counters:
    requests: int = 0
    errors: int = 0
    skipped_prefills: int = 0
    store_lookups: int = 0


@dataclass
class ProxySettings:
    model: str
    timeout_s: float = 600.0
    skip_prefill_below: int = 256  # skip the prefill when fewer tokens than this are not in the store
    probe_interval_s: float = 5.0
    admin_key: str | None = field(default_factory=lambda: os.environ.get("ADMIN_API_KEY") or None)


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    """An error in the OpenAI shape."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _excerpt(content: bytes, limit: int = 500) -> str:
    text = content.decode("utf-8", "replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."


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


async def served_models(client: httpx.AsyncClient, url: str) -> list[str]:
    """The model ids an instance's /v1/models lists; raises BackendError."""
    try:
        response = await client.get(url + "/v1/models", timeout=10.0)
        response.raise_for_status()
        return [str(m.get("id")) for m in response.json().get("data", [])]
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise BackendError(f"{url}/v1/models: {describe(exc)}") from exc


class Proxy:
    def __init__(self, settings: ProxySettings, prefill: list[str], decode: list[str],
                 policy: type[SchedulingPolicy], store: StoreView | None = None) -> None:  # fmt: skip
        self.settings = settings
        self.pools = {role: Pool(role, policy()) for role in ROLES}
        for url in prefill:
            self.pools["prefill"].add(url)
        for url in decode:
            self.pools["decode"].add(url)
        self.store = store
        self.counters = Counters()
        self.timeout = httpx.Timeout(settings.timeout_s, connect=min(settings.timeout_s, 10.0))
        self.client: httpx.AsyncClient | None = None
        self._prober: asyncio.Task[None] | None = None

    # ---- lifecycle
    async def open(self) -> None:
        self.client = httpx.AsyncClient(
            timeout=self.timeout, limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        )
        self._prober = asyncio.create_task(self._probe_loop())

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            try:
                await self._prober
            except asyncio.CancelledError:
                pass  # cancelled on purpose: the proxy is stopping
        if self.client is not None:
            await self.client.aclose()
        if self.store is not None:
            self.store.close()

    async def check(self, url: str) -> str | None:
        """Why instance `url` cannot serve (None: it serves the model)."""
        assert self.client is not None
        try:
            models = await served_models(self.client, url)
        except BackendError as exc:
            return str(exc)
        if self.settings.model not in models:
            return f"{url} serves {', '.join(models) or 'no model'}, not {self.settings.model}"
        return None

    async def _probe_loop(self) -> None:
        """Put instances that failed back in rotation once their /v1/models answers."""
        while True:
            await asyncio.sleep(self.settings.probe_interval_s)  # a period, not a synchronisation
            for pool in self.pools.values():
                for inst in [i for i in pool.instances if not i.healthy]:
                    why = await self.check(inst.url)
                    if why is None:
                        inst.healthy = True
                        log.info("%s %s answers again: back in rotation", inst.role, inst.url)

    def _failed(self, inst: Instance, why: str, *, out: bool) -> None:
        inst.errors += 1
        inst.last_error = why
        if out and inst.healthy:
            inst.healthy = False
            log.warning("%s %s failed (%s): out of rotation until it answers again", inst.role, inst.url, why)

    # ---- backends
    async def send(self, role: str, method: str, path: str, *, body: Any = None, headers: dict[str, str],
                   stream: bool = False, count: bool = True,
                   timeout: float | None = None) -> tuple[Instance, httpx.Response]:  # fmt: skip
        """Send to `role`'s instances in the policy's order, moving on while connections are
        refused. The caller ends the instance's in-flight count with `done`. `count`: a
        request of the client's (not the proxy's own, such as /tokenize)."""
        assert self.client is not None
        pool = self.pools[role]
        order = pool.order(body if isinstance(body, dict) else {})
        if not order:
            raise BackendError(f"no {role} instance (POST /instances/add adds one)")
        failures = []
        for inst in order:
            request = self.client.build_request(
                method, inst.url + path, json=body, headers=headers,
                timeout=self.timeout if timeout is None else httpx.Timeout(timeout),
            )  # fmt: skip
            inst.requests += count
            inst.in_flight += 1
            try:
                response = await self.client.send(request, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                inst.in_flight -= 1
                self._failed(inst, describe(exc), out=True)
                failures.append(f"{inst.url}: {describe(exc)}")
                continue
            except httpx.HTTPError as exc:
                inst.in_flight -= 1
                self._failed(inst, describe(exc), out=isinstance(exc, httpx.TimeoutException))
                raise BackendError(f"{role} backend {inst.url} failed: {describe(exc)}") from exc
            if response.status_code >= 500:
                inst.errors += 1
                inst.last_error = f"HTTP {response.status_code}"
            return inst, response
        raise BackendError(f"no {role} backend reachable ({'; '.join(failures)})")

    @staticmethod
    def done(inst: Instance) -> None:
        inst.in_flight -= 1

    # ---- the store
    async def prompt_tokens(
        self, body: dict[str, Any], chat: bool, headers: dict[str, str]
    ) -> list[int] | None:
        """The request's prompt as the engines will see it (vLLM's /tokenize on a decode
        instance, chat template included); None when it cannot be known here."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not all(_text_only(m) for m in messages):
                return None  # multimodal content: the connector keys on more than tokens
            req = {"model": body.get("model", self.settings.model),
                   **{k: body[k] for k in CHAT_TOKENIZE if k in body}}  # fmt: skip
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return list(prompt)
            if not isinstance(prompt, str):
                return None  # several prompts, or embeddings
            req = {"model": body.get("model", self.settings.model), "prompt": prompt}
            if "add_special_tokens" in body:
                req["add_special_tokens"] = body["add_special_tokens"]
        try:
            inst, response = await self.send(
                "decode",
                "POST",
                "/tokenize",
                body=req,
                headers=headers,
                count=False,
                timeout=TOKENIZE_TIMEOUT_S,
            )
        except BackendError as exc:
            log.debug("tokenize: %s", exc)
            return None
        try:
            tokens = json.loads(response.content).get("tokens") if response.status_code == 200 else None
        except (ValueError, AttributeError):
            tokens = None
        finally:
            self.done(inst)
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        return tokens

    async def should_skip_prefill(self, body: dict[str, Any], chat: bool, headers: dict[str, str]) -> bool:
        """Whether the decode can take the request alone: the tokens the store lacks are
        fewer than skip_prefill_below. A store or tokenizer that does not answer: no."""
        if self.store is None or self.settings.skip_prefill_below <= 0 or not self.store.up:
            return False
        if body.get("model", self.settings.model) != self.settings.model:
            return False  # a LoRA adapter: the connector keys on its name, not known here
        tokens = await self.prompt_tokens(body, chat, headers)
        if tokens is None:
            return False
        salt = body.get("cache_salt")
        held = await self.store.held_tokens_async(tokens, salt if isinstance(salt, str) else None)
        if held is None:
            return False
        self.counters.store_lookups += 1
        return len(tokens) - held < self.settings.skip_prefill_below

    def status(self) -> dict[str, Any]:
        store = None
        if self.store is not None:
            view = self.store
            store = {"namespace": view.target.namespace, "up": view.up, "errors": view.errors,
                     "timeouts": view.timeouts, "last_error": view.last_error}  # fmt: skip
        return {
            "model": self.settings.model,
            "policy": self.pools["decode"].policy.name,
            "skip_prefill_below": self.settings.skip_prefill_below if self.store is not None else None,
            **{role: [inst.status() for inst in pool.instances] for role, pool in self.pools.items()},
            "requests": self.counters.requests,
            "errors": self.counters.errors,
            "skipped_prefills": self.counters.skipped_prefills,
            "store_lookups": self.counters.store_lookups,
            "store": store,
        }


def _text_only(message: Any) -> bool:
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content)


def _headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}


def _passthrough(response: httpx.Response, content: bytes) -> Response:
    media = response.headers.get("content-type", "application/json")
    return Response(content=content, status_code=response.status_code, media_type=media)


def _is_json(request: Request) -> bool:
    return request.headers.get("content-type", "").split(";")[0].strip().lower() == "application/json"


async def _json_body(request: Request) -> dict[str, Any] | JSONResponse:
    if not _is_json(request):
        return error_response(415, "send the request body as JSON (Content-Type: application/json)",
                              "invalid_request_error")  # fmt: skip
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        return error_response(413, f"request body over {MAX_BODY_BYTES} bytes", "invalid_request_error")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        return error_response(400, f"request body is not JSON: {exc}", "invalid_request_error")
    if not isinstance(body, dict):
        return error_response(400, "request body must be a JSON object", "invalid_request_error")
    return body


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
        return {
            "status": "ok",
            **{role: [i.url for i in pool.instances] for role, pool in proxy.pools.items()},
        }

    @app.get("/status")
    async def status() -> dict[str, Any]:
        return proxy.status()

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            inst, response = await proxy.send("decode", "GET", "/v1/models", headers=_headers(request))
        except BackendError as exc:
            return error_response(502, str(exc), "bad_gateway")
        proxy.done(inst)
        return _passthrough(response, response.content)

    async def admin(request: Request) -> tuple[str, str] | JSONResponse:
        """The (role, url) of an admin request, or the refusal."""
        if proxy.settings.admin_key is None:
            return error_response(403, "the admin API is off: start the proxy with ADMIN_API_KEY set",
                                  "permission_error")  # fmt: skip
        given = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), proxy.settings.admin_key.encode()):
            return error_response(401, "X-API-Key is missing or wrong", "authentication_error")
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        role, instance = body.get("type"), body.get("instance")
        if role not in ROLES or not isinstance(instance, str):
            return error_response(400, 'give {"type": "prefill" or "decode", "instance": "HOST:PORT"}',
                                  "invalid_request_error")  # fmt: skip
        try:
            return role, normalize_url(instance)
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_request_error")

    @app.post("/instances/add")
    async def add_instance(request: Request) -> Response:
        asked = await admin(request)
        if isinstance(asked, JSONResponse):
            return asked
        role, url = asked
        why = await proxy.check(url)
        if why is not None:
            return error_response(400, f"not added: {why}", "invalid_request_error")
        proxy.pools[role].add(url)
        log.info("%s %s added", role, url)
        return JSONResponse({"added": {"type": role, "instance": url}, **proxy.status()})

    @app.post("/instances/remove")
    async def remove_instance(request: Request) -> Response:
        asked = await admin(request)
        if isinstance(asked, JSONResponse):
            return asked
        role, url = asked
        if not proxy.pools[role].remove(url):
            return error_response(404, f"no {role} instance {url}", "not_found_error")
        log.info("%s %s removed", role, url)
        return JSONResponse({"removed": {"type": role, "instance": url}, **proxy.status()})

    async def generate(request: Request, path: str, chat: bool) -> Response:
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        proxy.counters.requests += 1
        response = await _generate(proxy, body, _headers(request), path, chat)
        if response.status_code >= 500:
            proxy.counters.errors += 1
        return response

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "/v1/chat/completions", chat=True)

    return app


async def _generate(
    proxy: Proxy, body: dict[str, Any], headers: dict[str, str], path: str, chat: bool
) -> Response:
    # 1. prefill: the prompt's KV goes to the store; its one token is dropped. Skipped when
    # the store holds all but a few of the prompt's tokens: the decode computes those.
    if await proxy.should_skip_prefill(body, chat, headers):
        proxy.counters.skipped_prefills += 1
    else:
        try:
            inst, response = await proxy.send("prefill", "POST", path, body=prefill_request(body, chat),
                                              headers=headers)  # fmt: skip
        except BackendError as exc:
            return error_response(502, str(exc), "bad_gateway")
        proxy.done(inst)
        if response.status_code >= 500:
            message = (
                f"prefill backend {inst.url} answered {response.status_code}: {_excerpt(response.content)}"
            )
            return error_response(502, message, "bad_gateway")
        if response.status_code >= 400:  # the request itself is bad: say so as vLLM did
            return _passthrough(response, response.content)

    # 2. decode: the original request; the decode instance loads the prompt's KV from the store.
    stream = bool(body.get("stream"))
    try:
        inst, response = await proxy.send("decode", "POST", path, body=body, headers=headers, stream=stream)
    except BackendError as exc:
        return error_response(502, str(exc), "bad_gateway")
    if response.status_code >= 400 or not stream:
        try:
            content = await response.aread()
        except httpx.HTTPError as exc:
            return error_response(502, f"decode backend {inst.url} failed: {describe(exc)}", "bad_gateway")
        finally:
            await response.aclose()
            proxy.done(inst)
        if response.status_code >= 500:
            message = f"decode backend {inst.url} answered {response.status_code}: {_excerpt(content)}"
            return error_response(502, message, "bad_gateway")
        return _passthrough(response, content)

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            # The status line is sent already: end the stream with an error event, as vLLM does.
            log.warning("decode %s: stream broken: %s", inst.url, describe(exc))
            inst.errors += 1
            inst.last_error = describe(exc)
            message = f"decode backend {inst.url} failed mid-stream: {describe(exc)}"
            event = {"error": {"message": message, "type": "bad_gateway", "code": 502}}
            yield f"data: {json.dumps(event)}\n\n".encode()
        finally:
            await response.aclose()
            proxy.done(inst)

    media = response.headers.get("content-type", "text/event-stream")
    return StreamingResponse(relay(), status_code=response.status_code, media_type=media)
