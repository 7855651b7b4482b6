"""The proxy's backends: vLLM instances by role, their health and counters, and the
scheduling policy that orders them for a request."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

ROLES = ("prefill", "decode")


def normalize_url(value: str) -> str:
    """http://HOST:PORT from HOST:PORT or a URL; raises ValueError for what is neither."""
    value = value.strip()
    if not value:
        raise ValueError("an instance must be HOST:PORT or a URL, not empty")
    if "://" not in value:
        value = "http://" + value
    why = f"instance {value!r}: give HOST:PORT or http(s)://HOST:PORT"
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - parses the port: ValueError when it is not one
    except ValueError as exc:
        raise ValueError(why) from exc
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") or parts.query:
        raise ValueError(why)
    return f"{parts.scheme}://{parts.netloc}"


@dataclass(eq=False)  # one object per instance: compared (and hashed) by identity
class Instance:
    url: str
    role: str
    healthy: bool = True
    in_flight: int = 0
    requests: int = 0
    errors: int = 0
    last_error: str | None = None

    def status(self) -> dict[str, Any]:
        return {
            "instance": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "requests": self.requests,
            "errors": self.errors,
            "last_error": self.last_error,
        }


class SchedulingPolicy(ABC):
    """Orders a role's healthy instances for one request: the first is tried first, the
    others are fallbacks while connections are refused."""

    name: str

    @abstractmethod
    def order(self, instances: Sequence[Instance], body: dict[str, Any]) -> list[Instance]: ...


class RoundRobin(SchedulingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def order(self, instances: Sequence[Instance], body: dict[str, Any]) -> list[Instance]:
        if not instances:
            return []
        i = next(self._turn) % len(instances)
        return [*instances[i:], *instances[:i]]


class LeastBusy(SchedulingPolicy):
    """The instance with the fewest requests in flight first (ties: in list order)."""

    name = "least_busy"

    def order(self, instances: Sequence[Instance], body: dict[str, Any]) -> list[Instance]:
        return sorted(instances, key=lambda inst: inst.in_flight)


POLICIES: dict[str, type[SchedulingPolicy]] = {p.name: p for p in (RoundRobin, LeastBusy)}


@dataclass
class Pool:
    """The instances of one role."""

    role: str
    policy: SchedulingPolicy
    instances: list[Instance] = field(default_factory=list)

    def find(self, url: str) -> Instance | None:
        return next((inst for inst in self.instances if inst.url == url), None)

    def add(self, url: str) -> Instance:
        existing = self.find(url)
        if existing is not None:
            return existing
        inst = Instance(url, self.role)
        self.instances.append(inst)
        return inst

    def remove(self, url: str) -> bool:
        inst = self.find(url)
        if inst is None:
            return False
        self.instances.remove(inst)
        return True

    def order(self, body: dict[str, Any]) -> list[Instance]:
        """Healthy instances in the policy's order; none healthy: every instance (one may be back)."""
        healthy = [inst for inst in self.instances if inst.healthy]
        return self.policy.order(healthy or self.instances, body)
