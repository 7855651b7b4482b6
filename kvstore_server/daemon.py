"""One daemon run's parts, made in one place and handed to the servicer.

    parts = RunParts.create(config, store)   # the store id, the event log, the KV events
                                             # publisher, the Put budget, the idle reclaim
    servicer = Servicer(store, config, parts, Scope(tokens))
    ...
    parts.events.close()                     # shutdown, before the server stops: Watch ends
    parts.close()                            # after it stopped: reclaim thread, publisher

`create` also hooks the event log and the publisher to the store (its listeners, called
in commit order). kvstore_server.main.create_server builds the gRPC server around them.
"""

from __future__ import annotations

import uuid
from contextlib import ExitStack
from dataclasses import dataclass

from kvstore.kv_events_media import MEMORY, PERSISTENT
from kvstore.memory import trim_heap
from kvstore_server.config import ServerConfig
from kvstore_server.events import EventLog
from kvstore_server.idle import IdleReclaim
from kvstore_server.kv_events import KVEventsPublisher
from kvstore_server.putbuffer import PutBudget
from kvstore_server.store import Store


def new_store_id() -> str:
    """A daemon run's store id (what clients see as store_id): random, so a client that reconnects
    to a restarted daemon sees that its event sequences and leases mean nothing there.
    Always 32 hex digits: publish_store_id overwrites the file in place."""
    return uuid.uuid4().hex


@dataclass
class RunParts:
    """What one run of the daemon holds beside the store. Close once, after the server."""

    store_id: str
    events: EventLog  # behind Watch
    puts: PutBudget  # bytes of Put data buffered, across clients
    reclaim: IdleReclaim  # memory back to the kernel once bulk calls stop
    kv_events: KVEventsPublisher | None = None  # vLLM-format events, when configured

    @classmethod
    def create(cls, config: ServerConfig, store: Store, *, store_id: str | None = None) -> RunParts:
        """The parts for `store`, hooked to it. Raises OSError when the KV events publisher
        cannot bind, having closed what it made."""
        store_id = store_id or new_store_id()
        events = EventLog(config.event_window, store_id=store_id)
        puts = PutBudget(config.max_inflight_put_bytes)
        with ExitStack() as undo:
            kv_events = None
            if config.kv_events_endpoint is not None:
                # a removal is announced once per medium the daemon has (kv_events_media)
                tiers = (MEMORY, PERSISTENT) if store.memory is not None else (PERSISTENT,)
                kv_events = KVEventsPublisher(
                    config.kv_events_endpoint, config.kv_events_replay_endpoint,
                    topic=config.kv_events_topic, tiers=tiers,
                )  # fmt: skip
                undo.callback(kv_events.close)

            def release_memory() -> None:
                puts.drain()
                trim_heap()
                store.backend.release_memory()

            reclaim = IdleReclaim(release_memory)
            undo.pop_all()
        store.add_listener(events.record)
        if kv_events is not None:
            store.add_listener(kv_events.listener)
        return cls(store_id, events, puts, reclaim, kv_events)

    def close(self) -> None:
        """Stop the idle-memory thread and the KV events publisher; after the server stopped."""
        self.reclaim.close()
        if self.kv_events is not None:
            self.kv_events.close()
