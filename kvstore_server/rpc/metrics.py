"""The metrics interceptor: each KVStore call timed and counted by status code in a
kvstore_server.metrics.Metrics (which says what is recorded, and when).

    grpc.server(..., interceptors=[MetricsInterceptor(metrics)])
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kvstore import wire
from kvstore.service import SERVICE_PREFIX
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_server.metrics import Metrics


class _Call:
    """One instrumented call, recorded exactly once.

    When the handler returns or raises (before gRPC sends the status, so a
    client that has its answer finds it counted), or, if the client went away
    first, from gRPC's termination callback as CANCELLED / DEADLINE_EXCEEDED.
    """

    __slots__ = ("metrics", "method", "context", "started", "recorded", "lock")

    def __init__(self, metrics: Metrics, method: str, context: grpc.ServicerContext) -> None:
        self.metrics = metrics
        self.method = method
        self.context = context
        self.started = time.perf_counter()
        self.recorded = False
        self.lock = threading.Lock()
        if not context.add_callback(self.ended):
            self.ended()  # already over: the client went away before the handler ran

    def finish(self, code: grpc.StatusCode) -> None:
        """The handler returned or raised, with this status."""
        self._record(code)

    def ended(self) -> None:
        # gRPC's termination callback: runs after `finish` for a call that completed,
        # or first when the client cancelled (then possibly while the handler still runs).
        remaining = self.context.time_remaining()
        expired = remaining is not None and remaining <= 0
        self._record(grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED)

    def _record(self, code: grpc.StatusCode) -> None:
        with self.lock:
            if self.recorded:
                return
            self.recorded = True
        self.metrics.record(self.method, code.name, time.perf_counter() - self.started)


class MetricsInterceptor(grpc.ServerInterceptor):
    """Wraps each KVStore method handler to time it and record its status code."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        self._lock = threading.Lock()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        full_name = handler_call_details.method
        if handler is None or not full_name.startswith(SERVICE_PREFIX):
            return handler
        # The generic handler hands out the same handler object per method: wrap it once.
        cached = self._wrapped.get(full_name)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(full_name[len(SERVICE_PREFIX) :], handler)
        with self._lock:
            self._wrapped[full_name] = (handler, wrapped)
        return wrapped

    def _wrap(self, method: str, handler: Any) -> grpc.RpcMethodHandler:
        if handler.request_streaming and handler.response_streaming:
            return handler._replace(stream_stream=self._streaming(method, handler.stream_stream))  # type: ignore[no-any-return]
        if handler.request_streaming:
            behavior = handler.stream_unary
            if method == "Put":
                behavior = self._counting_put(behavior)
            return handler._replace(stream_unary=self._unary(method, behavior))  # type: ignore[no-any-return]
        if handler.response_streaming:
            return handler._replace(unary_stream=self._streaming(method, handler.unary_stream))  # type: ignore[no-any-return]
        return handler._replace(unary_unary=self._unary(method, handler.unary_unary))  # type: ignore[no-any-return]

    def _unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        metrics = self.metrics

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            call = _Call(metrics, method, context)
            try:
                response = behavior(request, context)
            except BaseException:
                call.finish(context.code() or grpc.StatusCode.UNKNOWN)
                raise
            call.finish(context.code() or grpc.StatusCode.OK)
            return response

        return unary

    def _streaming(self, method: str, behavior: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        metrics = self.metrics

        def observed(call: _Call, responses: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from responses
            except GeneratorExit:
                raise  # gRPC dropped the stream: the client went away; `ended` records it
            except BaseException:
                call.finish(context.code() or grpc.StatusCode.UNKNOWN)
                raise
            call.finish(context.code() or grpc.StatusCode.OK)

        def streaming(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            # not a generator itself: the call is registered even if the stream is never read
            call = _Call(metrics, method, context)
            try:
                responses = behavior(request, context)
            except BaseException:
                call.finish(context.code() or grpc.StatusCode.UNKNOWN)
                raise
            return observed(call, responses, context)

        return streaming

    def _counting_put(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        received = self.metrics.received_bytes

        def count(requests: Iterator[Any]) -> Iterator[Any]:
            for msg in requests:
                if isinstance(msg, wire.Chunk):
                    received.inc(len(msg.data))
                elif isinstance(msg, pb.PutRequest) and msg.WhichOneof("msg") == "chunk":
                    received.inc(len(msg.chunk.data))
                yield msg

        def put(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            return behavior(count(requests), context)

        return put
