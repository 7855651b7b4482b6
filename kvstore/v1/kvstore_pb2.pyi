from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_REASON_UNSPECIFIED: _ClassVar[StopReason]
    STOP_REASON_NONE: _ClassVar[StopReason]
    STOP_REASON_NOT_STORED: _ClassVar[StopReason]
    STOP_REASON_LAYER_SET_DIFFERS: _ClassVar[StopReason]
    STOP_REASON_CHECKSUM_FAILED: _ClassVar[StopReason]
    STOP_REASON_EVICTED: _ClassVar[StopReason]
    STOP_REASON_NO_ROOM: _ClassVar[StopReason]
    STOP_REASON_NOT_IN_MEMORY: _ClassVar[StopReason]
STOP_REASON_UNSPECIFIED: StopReason
STOP_REASON_NONE: StopReason
STOP_REASON_NOT_STORED: StopReason
STOP_REASON_LAYER_SET_DIFFERS: StopReason
STOP_REASON_CHECKSUM_FAILED: StopReason
STOP_REASON_EVICTED: StopReason
STOP_REASON_NO_ROOM: StopReason
STOP_REASON_NOT_IN_MEMORY: StopReason

class LayerSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "namespaces", "probe", "tiers", "lease", "lease_from", "lease_holders", "want_layout", "prefetch")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FROM_FIELD_NUMBER: _ClassVar[int]
    LEASE_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    WANT_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    namespaces: _containers.RepeatedScalarFieldContainer[bytes]
    probe: bool
    tiers: bool
    lease: bool
    lease_from: int
    lease_holders: int
    want_layout: bool
    prefetch: bool
    def __init__(self, namespace: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., namespaces: _Optional[_Iterable[bytes]] = ..., probe: _Optional[bool] = ..., tiers: _Optional[bool] = ..., lease: _Optional[bool] = ..., lease_from: _Optional[int] = ..., lease_holders: _Optional[int] = ..., want_layout: _Optional[bool] = ..., prefetch: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_blocks", "tiers", "persistent_read_rate", "fleet_read_rate", "leases", "store_id", "prefetch_blocks")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_READ_RATE_FIELD_NUMBER: _ClassVar[int]
    FLEET_READ_RATE_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    tiers: bytes
    persistent_read_rate: float
    fleet_read_rate: float
    leases: _containers.RepeatedCompositeFieldContainer[PinResponse]
    store_id: str
    prefetch_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ..., tiers: _Optional[bytes] = ..., persistent_read_rate: _Optional[float] = ..., fleet_read_rate: _Optional[float] = ..., leases: _Optional[_Iterable[_Union[PinResponse, _Mapping]]] = ..., store_id: _Optional[str] = ..., prefetch_blocks: _Optional[int] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("namespace", "block_hashes", "layers", "parent_hash", "token_ids", "layer_subset")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYER_SUBSET_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    parent_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    layer_subset: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., parent_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., layer_subset: _Optional[_Iterable[int]] = ...) -> None: ...

class LayerChunk(_message.Message):
    __slots__ = ("layer_index", "first_block", "data")
    LAYER_INDEX_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    layer_index: int
    first_block: int
    data: bytes
    def __init__(self, layer_index: _Optional[int] = ..., first_block: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutCommit(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "chunk", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    chunk: LayerChunk
    commit: PutCommit
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., chunk: _Optional[_Union[LayerChunk, _Mapping]] = ..., commit: _Optional[_Union[PutCommit, _Mapping]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("blocks_written", "blocks_skipped", "bytes_written", "blocks_evicted")
    BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    blocks_written: int
    blocks_skipped: int
    bytes_written: int
    blocks_evicted: int
    def __init__(self, blocks_written: _Optional[int] = ..., blocks_skipped: _Optional[int] = ..., bytes_written: _Optional[int] = ..., blocks_evicted: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "max_chunk_bytes", "layers")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    max_chunk_bytes: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., max_chunk_bytes: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ...) -> None: ...

class DropSelectRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "wait_seconds", "max_chunk_bytes", "layers")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    wait_seconds: float
    max_chunk_bytes: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., wait_seconds: _Optional[float] = ..., max_chunk_bytes: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ...) -> None: ...

class GetHeader(_message.Message):
    __slots__ = ("num_blocks", "layers", "stop_reason")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    stop_reason: StopReason
    def __init__(self, num_blocks: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., stop_reason: _Optional[_Union[StopReason, str]] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: GetHeader
    chunk: LayerChunk
    def __init__(self, header: _Optional[_Union[GetHeader, _Mapping]] = ..., chunk: _Optional[_Union[LayerChunk, _Mapping]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("all", "namespace", "block", "older_than_seconds", "target_bytes", "fleet")
    ALL_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    OLDER_THAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    FLEET_FIELD_NUMBER: _ClassVar[int]
    all: bool
    namespace: bytes
    block: BlockRef
    older_than_seconds: float
    target_bytes: int
    fleet: bool
    def __init__(self, all: _Optional[bool] = ..., namespace: _Optional[bytes] = ..., block: _Optional[_Union[BlockRef, _Mapping]] = ..., older_than_seconds: _Optional[float] = ..., target_bytes: _Optional[int] = ..., fleet: _Optional[bool] = ...) -> None: ...

class BlockRef(_message.Message):
    __slots__ = ("namespace", "block_hash")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    block_hash: bytes
    def __init__(self, namespace: _Optional[bytes] = ..., block_hash: _Optional[bytes] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("blocks_evicted", "bytes_freed", "fleet_objects_removed")
    BLOCKS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    FLEET_OBJECTS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    blocks_evicted: int
    bytes_freed: int
    fleet_objects_removed: int
    def __init__(self, blocks_evicted: _Optional[int] = ..., bytes_freed: _Optional[int] = ..., fleet_objects_removed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("blocks", "bytes_used", "capacity_bytes", "namespaces", "backend", "version", "uptime_seconds", "lookups", "hit_blocks", "miss_blocks", "puts", "blocks_written", "bytes_written", "bytes_read", "evictions", "checksum_failures", "memory_capacity_bytes", "memory_used_bytes", "memory_blocks", "memory_bytes", "pinned_bytes", "reserved_bytes", "write_behind_blocks", "write_behind_bytes", "written_behind", "write_behind_dropped", "memory_only_blocks", "promotions", "promoted_blocks", "memory_hit_blocks", "persistent_hit_blocks", "leases_expired", "reservations", "commits", "aborts", "pins", "memory_evictions", "probe_lookups", "partial_blocks", "partial_bytes", "partials_completed", "partials_expired", "part_layers_in_place", "part_layers_copied", "fleet_enabled", "fleet_up", "fleet_lookups", "fleet_hit_blocks", "fleet_bytes_fetched", "fleet_blocks_written", "fleet_bytes_written", "fleet_corrupt", "fleet_errors", "fleet_backlog_blocks", "fleet_backlog_bytes", "fleet_dropped", "fleet_skipped", "fleet_promoted_blocks", "promoted_bytes", "written_behind_bytes", "persistent_read_rate", "write_behind_rate", "fleet_read_rate", "unused_blocks", "persisted_on_reuse", "prefetched_blocks")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_BEHIND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WRITE_BEHIND_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BEHIND_FIELD_NUMBER: _ClassVar[int]
    WRITE_BEHIND_DROPPED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ONLY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PROBE_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARTIALS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    PARTIALS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    PART_LAYERS_IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    PART_LAYERS_COPIED_FIELD_NUMBER: _ClassVar[int]
    FLEET_ENABLED_FIELD_NUMBER: _ClassVar[int]
    FLEET_UP_FIELD_NUMBER: _ClassVar[int]
    FLEET_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    FLEET_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FLEET_BYTES_FETCHED_FIELD_NUMBER: _ClassVar[int]
    FLEET_BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    FLEET_BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    FLEET_CORRUPT_FIELD_NUMBER: _ClassVar[int]
    FLEET_ERRORS_FIELD_NUMBER: _ClassVar[int]
    FLEET_BACKLOG_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FLEET_BACKLOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    FLEET_DROPPED_FIELD_NUMBER: _ClassVar[int]
    FLEET_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    FLEET_PROMOTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BEHIND_BYTES_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_READ_RATE_FIELD_NUMBER: _ClassVar[int]
    WRITE_BEHIND_RATE_FIELD_NUMBER: _ClassVar[int]
    FLEET_READ_RATE_FIELD_NUMBER: _ClassVar[int]
    UNUSED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_ON_REUSE_FIELD_NUMBER: _ClassVar[int]
    PREFETCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes_used: int
    capacity_bytes: int
    namespaces: int
    backend: str
    version: str
    uptime_seconds: float
    lookups: int
    hit_blocks: int
    miss_blocks: int
    puts: int
    blocks_written: int
    bytes_written: int
    bytes_read: int
    evictions: int
    checksum_failures: int
    memory_capacity_bytes: int
    memory_used_bytes: int
    memory_blocks: int
    memory_bytes: int
    pinned_bytes: int
    reserved_bytes: int
    write_behind_blocks: int
    write_behind_bytes: int
    written_behind: int
    write_behind_dropped: int
    memory_only_blocks: int
    promotions: int
    promoted_blocks: int
    memory_hit_blocks: int
    persistent_hit_blocks: int
    leases_expired: int
    reservations: int
    commits: int
    aborts: int
    pins: int
    memory_evictions: int
    probe_lookups: int
    partial_blocks: int
    partial_bytes: int
    partials_completed: int
    partials_expired: int
    part_layers_in_place: int
    part_layers_copied: int
    fleet_enabled: bool
    fleet_up: bool
    fleet_lookups: int
    fleet_hit_blocks: int
    fleet_bytes_fetched: int
    fleet_blocks_written: int
    fleet_bytes_written: int
    fleet_corrupt: int
    fleet_errors: int
    fleet_backlog_blocks: int
    fleet_backlog_bytes: int
    fleet_dropped: int
    fleet_skipped: int
    fleet_promoted_blocks: int
    promoted_bytes: int
    written_behind_bytes: int
    persistent_read_rate: float
    write_behind_rate: float
    fleet_read_rate: float
    unused_blocks: int
    persisted_on_reuse: int
    prefetched_blocks: int
    def __init__(self, blocks: _Optional[int] = ..., bytes_used: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., namespaces: _Optional[int] = ..., backend: _Optional[str] = ..., version: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., lookups: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., miss_blocks: _Optional[int] = ..., puts: _Optional[int] = ..., blocks_written: _Optional[int] = ..., bytes_written: _Optional[int] = ..., bytes_read: _Optional[int] = ..., evictions: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., memory_capacity_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., memory_blocks: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., write_behind_blocks: _Optional[int] = ..., write_behind_bytes: _Optional[int] = ..., written_behind: _Optional[int] = ..., write_behind_dropped: _Optional[int] = ..., memory_only_blocks: _Optional[int] = ..., promotions: _Optional[int] = ..., promoted_blocks: _Optional[int] = ..., memory_hit_blocks: _Optional[int] = ..., persistent_hit_blocks: _Optional[int] = ..., leases_expired: _Optional[int] = ..., reservations: _Optional[int] = ..., commits: _Optional[int] = ..., aborts: _Optional[int] = ..., pins: _Optional[int] = ..., memory_evictions: _Optional[int] = ..., probe_lookups: _Optional[int] = ..., partial_blocks: _Optional[int] = ..., partial_bytes: _Optional[int] = ..., partials_completed: _Optional[int] = ..., partials_expired: _Optional[int] = ..., part_layers_in_place: _Optional[int] = ..., part_layers_copied: _Optional[int] = ..., fleet_enabled: _Optional[bool] = ..., fleet_up: _Optional[bool] = ..., fleet_lookups: _Optional[int] = ..., fleet_hit_blocks: _Optional[int] = ..., fleet_bytes_fetched: _Optional[int] = ..., fleet_blocks_written: _Optional[int] = ..., fleet_bytes_written: _Optional[int] = ..., fleet_corrupt: _Optional[int] = ..., fleet_errors: _Optional[int] = ..., fleet_backlog_blocks: _Optional[int] = ..., fleet_backlog_bytes: _Optional[int] = ..., fleet_dropped: _Optional[int] = ..., fleet_skipped: _Optional[int] = ..., fleet_promoted_blocks: _Optional[int] = ..., promoted_bytes: _Optional[int] = ..., written_behind_bytes: _Optional[int] = ..., persistent_read_rate: _Optional[float] = ..., write_behind_rate: _Optional[float] = ..., fleet_read_rate: _Optional[float] = ..., unused_blocks: _Optional[int] = ..., persisted_on_reuse: _Optional[int] = ..., prefetched_blocks: _Optional[int] = ...) -> None: ...

class BlockInfo(_message.Message):
    __slots__ = ("namespace", "block_hash", "parent_hash", "size_bytes", "num_layers", "created_at", "last_access_at", "num_children")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_AT_FIELD_NUMBER: _ClassVar[int]
    NUM_CHILDREN_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    block_hash: bytes
    parent_hash: bytes
    size_bytes: int
    num_layers: int
    created_at: float
    last_access_at: float
    num_children: int
    def __init__(self, namespace: _Optional[bytes] = ..., block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., num_layers: _Optional[int] = ..., created_at: _Optional[float] = ..., last_access_at: _Optional[float] = ..., num_children: _Optional[int] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("namespace", "limit", "page_token", "namespaces_only")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_ONLY_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    limit: int
    page_token: bytes
    namespaces_only: bool
    def __init__(self, namespace: _Optional[bytes] = ..., limit: _Optional[int] = ..., page_token: _Optional[bytes] = ..., namespaces_only: _Optional[bool] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("blocks", "next_page_token", "namespaces")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockInfo]
    next_page_token: bytes
    namespaces: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockInfo, _Mapping]]] = ..., next_page_token: _Optional[bytes] = ..., namespaces: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("namespace", "block_hash")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    block_hash: bytes
    def __init__(self, namespace: _Optional[bytes] = ..., block_hash: _Optional[bytes] = ...) -> None: ...

class LayerInfo(_message.Message):
    __slots__ = ("spec", "nbytes", "checksum")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    spec: LayerSpec
    nbytes: int
    checksum: int
    def __init__(self, spec: _Optional[_Union[LayerSpec, _Mapping]] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("block", "layers")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    block: BlockInfo
    layers: _containers.RepeatedCompositeFieldContainer[LayerInfo]
    def __init__(self, block: _Optional[_Union[BlockInfo, _Mapping]] = ..., layers: _Optional[_Iterable[_Union[LayerInfo, _Mapping]]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("from_sequence", "namespace")
    FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    from_sequence: int
    namespace: bytes
    def __init__(self, from_sequence: _Optional[int] = ..., namespace: _Optional[bytes] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("sequence", "kind", "namespace", "block_hashes", "parent_hashes", "timestamp", "store_id")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Event.Kind]
        STORED: _ClassVar[Event.Kind]
        REMOVED: _ClassVar[Event.Kind]
    KIND_UNSPECIFIED: Event.Kind
    STORED: Event.Kind
    REMOVED: Event.Kind
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    kind: Event.Kind
    namespace: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    timestamp: float
    store_id: str
    def __init__(self, sequence: _Optional[int] = ..., kind: _Optional[_Union[Event.Kind, str]] = ..., namespace: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hashes: _Optional[_Iterable[bytes]] = ..., timestamp: _Optional[float] = ..., store_id: _Optional[str] = ...) -> None: ...

class LocalAccessRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LocalAccessResponse(_message.Message):
    __slots__ = ("backend", "data_dir", "store_id", "namespace_prefix", "pid_namespace", "fleet")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DATA_DIR_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FLEET_FIELD_NUMBER: _ClassVar[int]
    backend: str
    data_dir: str
    store_id: str
    namespace_prefix: bytes
    pid_namespace: str
    fleet: bool
    def __init__(self, backend: _Optional[str] = ..., data_dir: _Optional[str] = ..., store_id: _Optional[str] = ..., namespace_prefix: _Optional[bytes] = ..., pid_namespace: _Optional[str] = ..., fleet: _Optional[bool] = ...) -> None: ...

class ArenaAccessRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ArenaAccessResponse(_message.Message):
    __slots__ = ("path", "size_bytes", "store_id", "namespace_prefix", "lease_seconds", "control_socket", "layouts")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    store_id: str
    namespace_prefix: bytes
    lease_seconds: float
    control_socket: str
    layouts: bool
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., store_id: _Optional[str] = ..., namespace_prefix: _Optional[bytes] = ..., lease_seconds: _Optional[float] = ..., control_socket: _Optional[str] = ..., layouts: _Optional[bool] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "layers", "parent_hash", "token_ids", "layer_subset", "in_place", "layout")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYER_SUBSET_FIELD_NUMBER: _ClassVar[int]
    IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    parent_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    layer_subset: _containers.RepeatedScalarFieldContainer[int]
    in_place: bool
    layout: bytes
    def __init__(self, namespace: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., parent_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., layer_subset: _Optional[_Iterable[int]] = ..., in_place: _Optional[bool] = ..., layout: _Optional[bytes] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "blocks", "offset", "lease_seconds", "refused_code", "refused", "extent_blocks", "position")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_CODE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    EXTENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    blocks: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    lease_seconds: float
    refused_code: int
    refused: str
    extent_blocks: int
    position: int
    def __init__(self, reservation_id: _Optional[int] = ..., blocks: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., refused_code: _Optional[int] = ..., refused: _Optional[str] = ..., extent_blocks: _Optional[int] = ..., position: _Optional[int] = ...) -> None: ...

class ReserveManyRequest(_message.Message):
    __slots__ = ("namespace", "layers", "layer_subset", "chains", "in_place", "layout")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_SUBSET_FIELD_NUMBER: _ClassVar[int]
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    layer_subset: _containers.RepeatedScalarFieldContainer[int]
    chains: _containers.RepeatedCompositeFieldContainer[ReserveChain]
    in_place: bool
    layout: bytes
    def __init__(self, namespace: _Optional[bytes] = ..., layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., layer_subset: _Optional[_Iterable[int]] = ..., chains: _Optional[_Iterable[_Union[ReserveChain, _Mapping]]] = ..., in_place: _Optional[bool] = ..., layout: _Optional[bytes] = ...) -> None: ...

class ReserveChain(_message.Message):
    __slots__ = ("block_hashes", "parent_hash", "token_ids")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveManyResponse(_message.Message):
    __slots__ = ("reservations",)
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    reservations: _containers.RepeatedCompositeFieldContainer[ReserveResponse]
    def __init__(self, reservations: _Optional[_Iterable[_Union[ReserveResponse, _Mapping]]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reservation_id", "checksums", "checksum_kind")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_KIND_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    checksums: bytes
    checksum_kind: str
    def __init__(self, reservation_id: _Optional[int] = ..., checksums: _Optional[bytes] = ..., checksum_kind: _Optional[str] = ...) -> None: ...

class CommitManyRequest(_message.Message):
    __slots__ = ("commits",)
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    commits: _containers.RepeatedCompositeFieldContainer[CommitRequest]
    def __init__(self, commits: _Optional[_Iterable[_Union[CommitRequest, _Mapping]]] = ...) -> None: ...

class CommitManyResponse(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[CommitAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[CommitAnswer, _Mapping]]] = ...) -> None: ...

class CommitAnswer(_message.Message):
    __slots__ = ("result", "refused_code", "refused")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_CODE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    result: PutResponse
    refused_code: int
    refused: str
    def __init__(self, result: _Optional[_Union[PutResponse, _Mapping]] = ..., refused_code: _Optional[int] = ..., refused: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    def __init__(self, reservation_id: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "want_layout")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    WANT_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    want_layout: bool
    def __init__(self, namespace: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., want_layout: _Optional[bool] = ...) -> None: ...

class ArenaRun(_message.Message):
    __slots__ = ("offset", "extent_blocks", "first", "count")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    EXTENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    offset: int
    extent_blocks: int
    first: int
    count: int
    def __init__(self, offset: _Optional[int] = ..., extent_blocks: _Optional[int] = ..., first: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("pin_id", "num_blocks", "layers", "runs", "checksums", "lease_seconds", "checksum_kinds", "stop_reason", "refused_code", "refused", "layout")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_KINDS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    REFUSED_CODE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    pin_id: int
    num_blocks: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    runs: _containers.RepeatedCompositeFieldContainer[ArenaRun]
    checksums: bytes
    lease_seconds: float
    checksum_kinds: _containers.RepeatedScalarFieldContainer[str]
    stop_reason: StopReason
    refused_code: int
    refused: str
    layout: bytes
    def __init__(self, pin_id: _Optional[int] = ..., num_blocks: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., runs: _Optional[_Iterable[_Union[ArenaRun, _Mapping]]] = ..., checksums: _Optional[bytes] = ..., lease_seconds: _Optional[float] = ..., checksum_kinds: _Optional[_Iterable[str]] = ..., stop_reason: _Optional[_Union[StopReason, str]] = ..., refused_code: _Optional[int] = ..., refused: _Optional[str] = ..., layout: _Optional[bytes] = ...) -> None: ...

class PinManyRequest(_message.Message):
    __slots__ = ("namespace", "chains", "want_layout")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    WANT_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    chains: _containers.RepeatedCompositeFieldContainer[PinChain]
    want_layout: bool
    def __init__(self, namespace: _Optional[bytes] = ..., chains: _Optional[_Iterable[_Union[PinChain, _Mapping]]] = ..., want_layout: _Optional[bool] = ...) -> None: ...

class PinChain(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PinManyResponse(_message.Message):
    __slots__ = ("pins",)
    PINS_FIELD_NUMBER: _ClassVar[int]
    pins: _containers.RepeatedCompositeFieldContainer[PinResponse]
    def __init__(self, pins: _Optional[_Iterable[_Union[PinResponse, _Mapping]]] = ...) -> None: ...

class PinProgress(_message.Message):
    __slots__ = ("pin", "ready_layers", "stop_reason", "ready_blocks")
    PIN_FIELD_NUMBER: _ClassVar[int]
    READY_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    READY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    pin: PinResponse
    ready_layers: int
    stop_reason: StopReason
    ready_blocks: int
    def __init__(self, pin: _Optional[_Union[PinResponse, _Mapping]] = ..., ready_layers: _Optional[int] = ..., stop_reason: _Optional[_Union[StopReason, str]] = ..., ready_blocks: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("pin_id", "corrupt_block_hashes", "all_holders")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    ALL_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    pin_id: int
    corrupt_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    all_holders: bool
    def __init__(self, pin_id: _Optional[int] = ..., corrupt_block_hashes: _Optional[_Iterable[bytes]] = ..., all_holders: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("was_pinned",)
    WAS_PINNED_FIELD_NUMBER: _ClassVar[int]
    was_pinned: bool
    def __init__(self, was_pinned: _Optional[bool] = ...) -> None: ...
