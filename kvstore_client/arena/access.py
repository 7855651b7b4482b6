"""`Arena`: a client's use of the daemon's arena, negotiated (ArenaAccess) lazily and
again after a restart; it hands out reservations and pins, one or many per round trip."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import errors
from kvstore_client.arena.load import Pinned
from kvstore_client.arena.mapping import MAPPINGS, ArenaUnavailable, Call, Mapping
from kvstore_client.arena.save import Reservation, _put_result
from kvstore_client.arena.views import layout_fields

if TYPE_CHECKING:
    from kvstore_client.types import Chain

log = logging.getLogger(__name__)


def _answered(answer: Any, make: Callable[[Any], Any]) -> Any:
    """One item's answer of a *Many call: make(answer), or the error it was refused with."""
    return errors.from_code(answer.refused_code, answer.refused) if answer.refused_code else make(answer)


def _each(
    items: Sequence[Any], one: Callable[[Any], Any], undo: Callable[[Any], Any] | None
) -> list[Any] | None:
    """one(item) for each item (a daemon without the *Many call): each result, or the
    KVStoreError it raised; None when one answered None (no arena any more), after undo()
    of the results made before."""
    out: list[Any] = []
    for item in items:
        try:
            result = one(item)
        except errors.KVStoreError as exc:
            out.append(exc)
            continue
        if result is None:
            for made in out:
                if undo is not None and not isinstance(made, errors.KVStoreError):
                    undo(made)
            return None
        out.append(result)
    return out


class Arena:
    """A client's use of the daemon's arena: negotiated lazily, re-negotiated when the
    daemon restarts (its run id changes). Never waits on another thread's negotiation."""

    def __init__(self, call: Call, spec_type: Any, retry_interval: float = 30.0) -> None:
        self._call = call
        self._spec_type = spec_type
        self._retry_interval = retry_interval
        self._streams = True  # the daemon answers PinStream (until it says it does not)
        self._layouts = False  # the daemon reads a Reserve's layout as bytes (ArenaAccess says)
        self._lock = threading.Lock()
        self._mapping: Mapping | None = None
        self._prefix = b""
        self._negotiating = False
        self._next_try = 0.0
        self._reason: str | None = None
        self._closed = False

    def mapping(self) -> Mapping | None:
        """The arena, mapped; None while it cannot be used (then use gRPC)."""
        stale = None
        with self._lock:
            mapping = self._mapping
            if mapping is not None and mapping.current():
                return mapping
            if mapping is not None:  # the daemon restarted: ask again now
                stale, self._mapping = mapping, None
                self._next_try = 0.0
            if self._negotiating or self._closed or time.monotonic() < self._next_try:
                opening = False
            else:
                opening = self._negotiating = True
                self._next_try = time.monotonic() + self._retry_interval
        if stale is not None:
            MAPPINGS.let_go(stale)
        if not opening:
            return None
        opened = None
        try:
            opened = self._open()
        except ArenaUnavailable as exc:
            if str(exc) != self._reason:
                self._reason = str(exc)
                log.info("arena off, using gRPC: %s", exc)
        with self._lock:
            self._negotiating = False
            if self._closed and opened is not None:
                stale, opened = opened, None
            else:
                stale, self._mapping = None, opened
        if stale is not None:
            MAPPINGS.let_go(stale)
        if opened is not None:
            self._reason = None
        return opened

    def _open(self) -> Mapping:
        try:
            resp = self._call("ArenaAccess", pb.ArenaAccessRequest())
        except errors.KVStoreError as exc:
            raise ArenaUnavailable(f"the daemon does not offer its arena: {exc}") from exc
        path, size, store_id = Path(resp.path), resp.size_bytes, resp.store_id
        self._layouts = resp.layouts
        return MAPPINGS.hold((str(path), store_id), lambda: Mapping(path, size, store_id))

    def reserve(
        self,
        namespace: bytes,
        hashes: Sequence[bytes],
        layers: Sequence[Any],
        parent_hash: bytes,
        timeout: float | None = None,
        token_ids: Sequence[int] = (),
        subset: Sequence[int] = (),
    ) -> Reservation | None:
        """A reservation; None when the arena is off (use Put). A reservation with no blocks
        means every block is stored already. `subset`: a partial save of these of `layers`
        (the reservation then holds only them, in that order)."""
        mapping = self.mapping()
        if mapping is None:
            return None
        req = pb.ReserveRequest(
            namespace=namespace,
            block_hashes=hashes,
            parent_hash=parent_hash,
            **layout_fields(layers, self._layouts),
            token_ids=token_ids,
            layer_subset=subset,
            in_place=bool(subset),
        )
        try:
            resp = self._call("Reserve", req, timeout)
        except errors.NotOffered:
            self._off()
            return None
        return Reservation(self._call, mapping, resp, layers, subset)

    def reserve_many(
        self,
        namespace: bytes,
        chains: Sequence[Chain],
        layers: Sequence[Any],
        timeout: float | None = None,
        subset: Sequence[int] = (),
    ) -> list[Reservation | errors.KVStoreError] | None:
        """A reservation per chain (saves of one layout) in one round trip, in order: each
        a Reservation, or the error a reserve of that chain alone would have raised. None
        when the arena is off. A daemon without ReserveMany is asked chain by chain."""
        mapping = self.mapping()
        if mapping is None:
            return None
        req = pb.ReserveManyRequest(
            namespace=namespace,
            **layout_fields(layers, self._layouts),
            layer_subset=subset,
            in_place=bool(subset),
            chains=[
                pb.ReserveChain(block_hashes=c.hashes, parent_hash=c.parent_hash, token_ids=c.token_ids)
                for c in chains
            ],  # fmt: skip
        )
        try:
            answers = self._many("ReserveMany", req, "reservations", len(chains), timeout)
        except errors.NotOffered:
            self._off()
            return None
        if answers is None:

            def one(c: Chain) -> Reservation | None:
                return self.reserve(namespace, c.hashes, layers, c.parent_hash, timeout, c.token_ids, subset)

            return _each(chains, one, Reservation.abort)
        return [
            _answered(answer, lambda a: Reservation(self._call, mapping, a, layers, subset))
            for answer in answers
        ]

    def commit_many(
        self,
        items: Sequence[tuple[Reservation, Sequence[int] | bytes | None, str]],
        timeout: float | None = None,
    ) -> list[Any]:
        """Reservation.commit(sums, kind=kind) of each item in one round trip, in order: each
        a PutResult, or the KVStoreError its commit alone would have raised (that
        reservation may then be aborted). A daemon without CommitMany is asked one commit
        at a time."""
        requests = [res.commit_request(sums, kind=kind) for res, sums, kind in items]
        sent = [req for req in requests if req is not None]
        if not sent:
            return [_put_result(None) for _ in items]
        try:
            answers = self._many(
                "CommitMany", pb.CommitManyRequest(commits=sent), "answers", len(sent), timeout
            )
        except errors.KVStoreError:
            for res, _, _ in items:
                res.done = False  # not committed, as far as we know: abort() may give them back
            raise
        if answers is None:
            results = _each(sent, lambda req: _put_result(self._call("Commit", req, timeout)), None) or []
        else:
            results = [_answered(answer, lambda a: _put_result(a.result)) for answer in answers]
        got = iter(results)
        out = [next(got) if req is not None else _put_result(None) for req in requests]
        for (res, _, _), answer in zip(items, out, strict=True):
            if isinstance(answer, errors.KVStoreError):
                res.done = False  # not committed: abort() gives the extent back
        return out

    def _many(
        self, method: str, request: Any, field: str, count: int, timeout: float | None
    ) -> list[Any] | None:
        """The answers of a *Many call (its response's `field`), one per item, in order;
        None from a daemon that predates the call (UNIMPLEMENTED): ask item by item."""
        try:
            resp = self._call(method, request, timeout)
        except errors.StoreInternalError as exc:
            if exc.code != "UNIMPLEMENTED":
                raise
            return None
        answers = list(getattr(resp, field))
        if len(answers) != count:
            raise errors.StoreInternalError(f"{method} answered {len(answers)} of {count}")
        return answers

    def pin(
        self, namespace: bytes, hashes: Sequence[bytes], timeout: float | None = None, *, stream: bool = False
    ) -> Pinned | None:
        mapping = self.mapping()
        if mapping is None:
            return None
        sent = time.monotonic()
        request = pb.PinRequest(namespace=namespace, block_hashes=hashes, want_layout=True)
        try:
            if stream and self._streams:
                call = self._call("PinStream", request, timeout)
                try:
                    first = next(call)
                except errors.KVStoreError as exc:
                    if exc.code != "UNIMPLEMENTED":
                        raise
                    self._streams = False  # a daemon that predates it
                    log.info("the daemon has no PinStream: pins wait for their promotion")
                except StopIteration:
                    raise errors.StoreInternalError("PinStream ended without an answer") from None
                else:
                    return Pinned(self._call, mapping, first.pin, self._spec_type, sent, (call, first))
            resp = self._call("Pin", request, timeout)
        except errors.NotOffered:
            self._off()
            return None
        return Pinned(self._call, mapping, resp, self._spec_type, sent)

    def leased(self, pin: pb.PinResponse, store_id: str, taken: float) -> Pinned | None:
        """A lookup's lease of one namespace (kvstore_client.Lease: `pin`, its daemon run
        and when it was taken) as a Pinned, to load from like a Pin's answer and release
        after; None when this client cannot use it (no arena, or another daemon run's
        arena mapped: the caller gives its share back, e.g. with release_lease)."""
        mapping = self.mapping()
        if mapping is None or mapping.store_id != store_id or not pin.pin_id:
            return None
        return Pinned(self._call, mapping, pin, self._spec_type, taken)

    def pin_many(
        self, namespace: bytes, chains: Sequence[Sequence[bytes]], timeout: float | None = None
    ) -> list[Pinned | errors.KVStoreError] | None:
        """A pin of each chain (one namespace) in one round trip, in order: each a Pinned
        (its blocks in place: promoted first where needed), or the error a pin of that
        chain alone would have raised. None when the arena is off. A daemon without
        PinMany is asked chain by chain."""
        mapping = self.mapping()
        if mapping is None:
            return None
        sent = time.monotonic()
        request = pb.PinManyRequest(
            namespace=namespace, chains=[pb.PinChain(block_hashes=c) for c in chains], want_layout=True
        )
        try:
            answers = self._many("PinMany", request, "pins", len(chains), timeout)
        except errors.NotOffered:
            self._off()
            return None
        if answers is None:
            return _each(chains, lambda hashes: self.pin(namespace, hashes, timeout), Pinned.release)
        return [
            _answered(pin, lambda a: Pinned(self._call, mapping, a, self._spec_type, sent)) for pin in answers
        ]

    def _off(self) -> None:
        with self._lock:
            mapping, self._mapping = self._mapping, None
            self._next_try = time.monotonic() + self._retry_interval
        if mapping is not None:
            MAPPINGS.let_go(mapping)

    def close(self) -> None:
        """Let go of the mapping (its client is closing); later calls use no arena."""
        with self._lock:
            self._closed = True
            mapping, self._mapping = self._mapping, None
        if mapping is not None:
            MAPPINGS.let_go(mapping)
