"""Bearer tokens, tenants and roles.

The token file (TOML) maps tokens to a tenant and a role:

    [[tokens]]
    token = "s3cret-writer"        # or token_sha256 = "<hex>", to keep no plain tokens at rest
    tenant = "team-a"
    role = "writer"                 # reader | writer | admin

Roles nest: a reader may Lookup, Get, Describe, List, Stats, Watch, LocalAccess,
ArenaAccess, Pin and Release; a writer also Put, Reserve, Commit, Abort and DropSelect
(which removes what it takes); an admin also Evict. The tenant is enforced by the
server as part of every namespace (see Scope): one tenant can never hit, read, list,
watch or evict another's blocks over gRPC. (Local reads and the arena, off by default
with tokens, go around this: whoever can read the data directory or map the arena can
read every tenant.)
Health checks and server reflection stay open (load balancers need them).

Clients send `authorization: Bearer <token>`. Tokens are compared in constant
time, against every entry, by their SHA-256 digests.

This module imports no grpc: the gRPC side (AuthInterceptor, which refuses calls, and
Scope, which maps a caller's namespaces) is kvstore_server.rpc.auth.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROLES = ("reader", "writer", "admin")
# Tenant names: letters, digits, '.', '_', '-'; never NUL, which ends the tenant in
# a stored namespace (see tenant_prefix).
TENANT_PATTERN = "[A-Za-z0-9._-]{1,64}"
_TENANT_RE = re.compile(TENANT_PATTERN)

# the least role each RPC needs
METHOD_ROLES = {
    "Lookup": "reader",
    "Get": "reader",
    "Describe": "reader",
    "List": "reader",
    "Stats": "reader",
    "Watch": "reader",
    "LocalAccess": "reader",
    "ArenaAccess": "reader",
    "Pin": "reader",
    "PinMany": "reader",
    "PinStream": "reader",
    "Release": "reader",
    "Put": "writer",
    "Reserve": "writer",
    "ReserveMany": "writer",
    "Commit": "writer",
    "CommitMany": "writer",
    "Abort": "writer",
    "DropSelect": "writer",
    "Evict": "admin",
}


@dataclass(frozen=True)
class Principal:
    tenant: str
    role: str

    def may(self, role: str) -> bool:
        return ROLES.index(self.role) >= ROLES.index(role)


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    principal: Principal


class TokenTable:
    """Tokens from a token file; `resolve` is constant-time in the token presented."""

    def __init__(self, entries: list[_Entry]) -> None:
        if not entries:
            raise ValueError("the token file defines no tokens")
        self._entries = entries

    @classmethod
    def load(cls, path: Path) -> TokenTable:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        entries = []
        for i, item in enumerate(doc.get("tokens", [])):
            where = f"{path}: tokens[{i}]"
            unknown = set(item) - {"token", "token_sha256", "tenant", "role"}
            if unknown:
                raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
            role, tenant = item.get("role"), item.get("tenant")
            if role not in ROLES:
                raise ValueError(f"{where}: role must be one of {', '.join(ROLES)}, not {role!r}")
            if not isinstance(tenant, str) or _TENANT_RE.fullmatch(tenant) is None:
                raise ValueError(f"{where}: tenant {tenant!r} must match {TENANT_PATTERN}")
            if ("token" in item) == ("token_sha256" in item):
                raise ValueError(f"{where}: give exactly one of token, token_sha256")
            if "token" in item:
                token = item["token"]
                if not isinstance(token, str) or len(token) < 16:
                    raise ValueError(f"{where}: token must be a string of at least 16 characters")
                digest = hashlib.sha256(token.encode()).digest()
            else:
                try:
                    digest = bytes.fromhex(item["token_sha256"])
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{where}: token_sha256 must be 64 hex digits") from exc
                if len(digest) != 32:
                    raise ValueError(f"{where}: token_sha256 must be 64 hex digits")
            entries.append(_Entry(digest, Principal(tenant, role)))
        return cls(entries)

    def resolve(self, token: str) -> Principal | None:
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for entry in self._entries:  # no early exit: same work whichever entry matches
            if hmac.compare_digest(entry.digest, digest):
                found = entry.principal
        return found


def bearer_token(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer ") :]
    return None


def tenant_prefix(tenant: str) -> bytes:
    """What the server puts before every namespace of `tenant`: `0x00 || T || 0x00`.

    Unambiguous because tenant names never contain NUL (TENANT_PATTERN): the
    second NUL of a stored namespace ends the tenant, so no (tenant, namespace)
    pair stores as another's, whatever bytes the namespaces hold.
    """
    return b"\x00" + tenant.encode() + b"\x00"
