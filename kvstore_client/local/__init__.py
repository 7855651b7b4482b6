"""The same-host fast path: read blocks straight from a co-located daemon's files.

gRPC moves about 1.5 GB/s in Python, and on a small host the daemon competes
with the engine for cores. A client on the daemon's host (or with its data
volume mounted) can instead open the backend read-only and copy blocks from the
page cache: one copy, no daemon CPU, no round trip. gRPC stays the control
plane: Put, DropSelect, Evict and the rest go to the daemon, and every lookup
answered from the files is also sent to the daemon, without waiting for it, so
the blocks' recency and the hit counters stay right.

    KVStoreClient(address, local_reads=True)   # lookup, get_stream, select use it when they can

    reads.py    LocalReads (negotiation, the shared opened files), LocalSource
    readers.py  read-only LMDB and block-file readers over kvstore.layouts

How a client earns it: the LocalAccess RPC names the daemon's data directory,
backend, tenant prefix and a random per-run store_id, which the daemon also
writes to `<data_dir>/STORE_ID`. Only a client that reads that same id from
that directory (same files, so the same host) opens the backend. Each read
re-checks the id, so a restarted daemon is noticed and re-negotiated.

Every layer's checksum is verified before its bytes are handed out, as the
daemon does. A mismatch is reported to the daemon (it re-reads the block,
counts the failure and removes it) and ends that stream with LocalDataCorrupt;
`select` then asks the daemon for the good prefix. Files that cannot be opened
or read turn the fast path off (calls use gRPC) until the next negotiation: it
is an optimisation, never a second source of truth.

LMDB gives readers a consistent snapshot while the daemon commits; the
snapshot (a read transaction) is held only while one stream is read, so it
pins old pages for milliseconds. Readers need write access to the
environment's lock.mdb, and the daemon and its clients must share a PID
namespace (LMDB tracks readers by PID).
"""

from kvstore_client.local.reads import LocalReads, LocalSource, LocalUnavailable

__all__ = ["LocalReads", "LocalSource", "LocalUnavailable"]
