"""Auth at the gRPC edge: AuthInterceptor refuses calls without a valid bearer token or
beyond the token's role; Scope maps a caller's namespaces to its tenant's stored ones.
The token file, roles and tenants themselves: kvstore_server.auth.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from kvstore.service import SERVICE_PREFIX
from kvstore_server.auth import METHOD_ROLES, TokenTable, bearer_token, tenant_prefix

_STREAMING_REQUESTS = {"Put"}
_STREAMING_RESPONSES = {"Get", "DropSelect", "Watch"}


def _refusal(method: str, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    if method in _STREAMING_REQUESTS:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if method in _STREAMING_RESPONSES:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class AuthInterceptor(grpc.ServerInterceptor):
    """UNAUTHENTICATED without a valid token, PERMISSION_DENIED beyond the token's role."""

    def __init__(self, tokens: TokenTable) -> None:
        self.tokens = tokens

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        if not details.method.startswith(SERVICE_PREFIX):
            return continuation(details)  # health, reflection
        method = details.method[len(SERVICE_PREFIX) :]
        needed = METHOD_ROLES.get(method)
        if needed is None:
            return continuation(details)  # unknown method: gRPC answers UNIMPLEMENTED
        token = bearer_token(details.invocation_metadata)
        principal = self.tokens.resolve(token) if token is not None else None
        if principal is None:
            return _refusal(method, grpc.StatusCode.UNAUTHENTICATED, "a valid bearer token is required")
        if not principal.may(needed):
            return _refusal(
                method,
                grpc.StatusCode.PERMISSION_DENIED,
                f"role {principal.role!r} may not call {method} (needs {needed})",
            )
        return continuation(details)


class Scope:
    """Maps client namespaces to stored ones and back, per caller.

    Without auth it is the identity. With auth, tenant T's namespace N is stored
    as `tenant_prefix(T) || N`: unreachable from any other tenant.
    """

    def __init__(self, tokens: TokenTable | None) -> None:
        self.tokens = tokens

    def tenant(self, context: grpc.ServicerContext) -> bytes:
        """The caller's tenant: the bytes before each of its stored namespaces
        (`tenant_prefix`; b"" without auth)."""
        if self.tokens is None:
            return b""
        token = bearer_token(context.invocation_metadata())
        principal = self.tokens.resolve(token) if token is not None else None
        if principal is None:  # the interceptor let it through: cannot happen
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid bearer token is required")
            raise RuntimeError("context.abort returned")  # it raises; this keeps type checkers honest
        return tenant_prefix(principal.tenant)
