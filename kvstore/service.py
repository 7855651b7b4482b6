"""Names the daemon and its clients must agree on, defined once: the gRPC service's name
and the keys of a Watch stream's initial metadata (see WatchRequest in the proto).

Used by both the daemon and the client; imports nothing.
"""

from __future__ import annotations

from typing import Final

# The service of protos/kvstore/v1/kvstore.proto: what health checks name, and
# (SERVICE_PREFIX + method) each call's path.
SERVICE_NAME: Final = "kvstore.v1.KVStore"
SERVICE_PREFIX: Final = f"/{SERVICE_NAME}/"

# A Watch stream's initial metadata, sent once the subscription is in place: the
# daemon run's id, and the sequence of the first event the stream will carry.
WATCH_STORE_ID_KEY: Final = "kvstore-store-id"
WATCH_START_SEQUENCE_KEY: Final = "kvstore-start-sequence"
