"""kvstore-cli: inspect and manage a running kvstore daemon.

    kvstore-cli [--address HOST:PORT] [--timeout S] [--json] COMMAND ...

Commands:
    health                          SERVING or NOT_SERVING; exit 0 only when SERVING
    stats                           blocks, bytes used of capacity, uptime, counters
    ls [--namespace NS] [--limit N] stored blocks in (namespace, hash) order (default 100; 0: all)
    show HASH --namespace NS        one block: parent, children, times, and its layers
                                    (HASH: 64 hex digits, or a unique prefix of 4 or more)
    evict SELECTOR                  remove blocks; prints blocks evicted and bytes freed.
                                    SELECTOR is exactly one of:
        --all [--yes]                   every block (asks first unless --yes)
        --namespace NS                  every block of one namespace (exit 1 if it holds none)
        --block HASH --namespace NS     one block and all its descendants (HASH as for show)
        --older-than DURATION           blocks last used longer ago (90s, 15m, 2h, 7d, seconds)
        --down-to SIZE                  least recently used chain tails until usage <= SIZE (10GiB)
    watch [--from SEQ] [--namespace NS] [--count N]
                                    one line per stored/removed event, until Ctrl-C (exit 0)
                                    or N events; --from replays from sequence SEQ
    explain --namespace NS [--block-size N] [--hash-root ROOT] [FILE]
                                    which blocks of a prompt (token ids from FILE or stdin)
                                    are stored, where its chain breaks, tokens reusable;
                                    hints when nothing hits (block size, namespace)
    arenas [--memory-dir DIR] [--remove-orphans [--include-unowned]]
                                    on the daemon's host, no daemon needed: the arena files
                                    in DIR (/dev/shm): live, recoverable, orphan, unowned

Security: --token (or $KVSTORE_TOKEN) sends a bearer token; --tls-ca (or
$KVSTORE_TLS_CA) connects with TLS, --tls-cert/--tls-key add a client certificate.

The address defaults to $KVSTORE_ADDRESS, else 127.0.0.1:50051; a HOST without
a port means the daemon's port, 50051. --address, --timeout and --json may also
follow the command. Namespaces are UTF-8 text, or hex after `0x` (0x6e73 is
"ns"); namespaces that are not printable text are shown in that form. Block
hashes are 64 hex digits; `show` and `evict --block` also take a prefix of at
least 4 digits (ls shows 16) that names one block of the namespace, as git takes
abbreviated commit ids. Where a namespace holds no blocks, `explain` and `evict
--namespace` name the stored namespaces it may have meant.

Exit status: 0 success; 1 an error reported by the daemon, an unknown block or
hash prefix (or one that names several blocks), `evict --namespace` of a
namespace that holds no blocks, a refused confirmation, or health not SERVING;
2 a usage error or an unreachable daemon.

NOTE: over 500 lines: the usage above, the parser that implements it and main()'s
mapping of errors to these exit statuses are one contract, and the daemon commands
share the client setup, the output helpers and `_resolve_block`. `arenas` lives
apart (kvstore_cli.arenas) because it needs no daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from itertools import islice
from typing import Any

from kvstore.sizes import attach_values, format_size, parse_size
from kvstore_cli import arenas as arenas_command
from kvstore_cli.formatting import (
    HASH_HEX_DIGITS,
    SHORT_HASH_DIGITS,
    format_duration,
    format_percent,
    format_table,
    format_timestamp,
    missing_namespace_hint,
    parse_duration,
    parse_hash_prefix,
    parse_namespace,
    parse_token_ids,
    render_namespace,
    shell_namespace,
    short_hash,
)
from kvstore_client import Event, KVStoreClient
from kvstore_client.address import with_default_port
from kvstore_client.errors import KVStoreError, StoreUnavailable
from kvstore_client.hashing import block_hashes, connector_block_size, connector_hash_root

PROG = "kvstore-cli"
DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TIMEOUT = 10.0
DEFAULT_LIMIT = 100
PAGE_SIZE = 1000
LS_HEADERS = ("NAMESPACE", "HASH", "SIZE", "CHILDREN", "LAST ACCESS", "CREATED")
LAYER_HEADERS = ("LAYER", "DTYPE", "SHAPE", "BYTES", "CHECKSUM")
EXPLAIN_HEADERS = ("BLOCK", "TOKENS", "HASH", "STATUS")
DEFAULT_EXPLAIN_BLOCK_SIZE = 32
# blocks named in the error for a hash prefix that matches several
PREFIX_CANDIDATES_SHOWN = 4
# flags whose value may start with '-' (taken as the value, so its parser can refuse it)
VALUE_FLAGS = ("--down-to",)
# explain's statuses: in the stored prefix; the first block not stored (the chain
# breaks there); after the break, stored but not reachable as a prefix, or not stored.
HIT, MISS, UNREACHABLE, MISSING = "hit", "miss", "unreachable", "missing"
_STATUS_TEXT = {
    HIT: "hit",
    MISS: "MISS  <- the chain breaks here",
    UNREACHABLE: "stored, unreachable (behind the break)",
    MISSING: "missing",
}

Command = Callable[[KVStoreClient, argparse.Namespace], int]


class UsageError(Exception):
    """A command-line combination argparse cannot express; exits 2 like argparse errors."""


class Failure(Exception):
    """What was asked cannot be done, found out from the daemon's answers (an unknown or
    ambiguous hash prefix, a namespace that holds no blocks); exits 1 with the message."""


# ---- output ------------------------------------------------------------------------
def _emit_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


def _error(message: str) -> None:
    print(f"{PROG}: {' '.join(message.split())}", file=sys.stderr)


def _block_json(block: Any) -> dict[str, Any]:
    return {
        "namespace": render_namespace(block.namespace),
        "hash": block.block_hash.hex(),
        "parent_hash": block.parent_hash.hex(),
        "size_bytes": block.size_bytes,
        "num_children": block.num_children,
        "created_at": block.created_at,
        "last_access_at": block.last_access_at,
    }


def _ago(now: float, then: float) -> str:
    return f"{format_duration(now - then)} ago"


# ---- commands ----------------------------------------------------------------------
def cmd_health(client: KVStoreClient, args: argparse.Namespace) -> int:
    status = client.health()
    if args.json:
        _emit_json({"address": args.address, "status": status})
    else:
        print(status)
    return 0 if status == "SERVING" else 1


def cmd_stats(client: KVStoreClient, args: argparse.Namespace) -> int:
    s = client.stats()
    if args.json:
        _emit_json(s)
        return 0
    rows = [
        ("blocks", s["blocks"]),
        ("namespaces", s["namespaces"]),
        ("used", f"{format_size(s['bytes_used'])} ({format_percent(s['bytes_used'], s['capacity_bytes'])})"),
        ("capacity", format_size(s["capacity_bytes"])),
        ("backend", s["backend"]),
        ("version", s["version"]),
        ("uptime", format_duration(s["uptime_seconds"])),
        ("lookups", s["lookups"]),
        ("hit blocks", s["hit_blocks"]),
        ("miss blocks", s["miss_blocks"]),
        ("hit rate", format_percent(s["hit_blocks"], s["hit_blocks"] + s["miss_blocks"])),
        ("puts", s["puts"]),
        ("blocks written", s["blocks_written"]),
        ("bytes written", format_size(s["bytes_written"])),
        ("bytes read", format_size(s["bytes_read"])),
        ("evictions", s["evictions"]),
        ("checksum failures", s["checksum_failures"]),
    ]
    if s["memory_capacity_bytes"]:
        rows += [
            ("memory tier", f"{s['memory_blocks']} blocks, {format_size(s['memory_bytes'])}"),
            (
                "memory used",
                f"{format_size(s['memory_used_bytes'])} of {format_size(s['memory_capacity_bytes'])} "
                f"({format_percent(s['memory_used_bytes'], s['memory_capacity_bytes'])})",
            ),  # fmt: skip
            ("pinned", format_size(s["pinned_bytes"])),
            ("reserved", format_size(s["reserved_bytes"])),
            ("memory hits", f"{s['memory_hit_blocks']} blocks"),
            ("persistent hits", f"{s['persistent_hit_blocks']} blocks"),
            (
                "promotions",
                f"{s['promotions']} ({s['promoted_blocks']} blocks, {s['prefetched_blocks']} prefetched)",
            ),
            (
                "write-behind backlog",
                f"{s['write_behind_blocks']} blocks, {format_size(s['write_behind_bytes'])}",
            ),
            ("written behind", s["written_behind"]),
            ("write-behind dropped", s["write_behind_dropped"]),
            ("memory only", s["memory_only_blocks"]),
            ("not loaded since saved", s["unused_blocks"]),
            ("written behind on reuse", s["persisted_on_reuse"]),
            ("commits", s["commits"]),
            ("expired leases", s["leases_expired"]),
        ]
    else:
        rows.append(("memory tier", "off"))
    if s["fleet_enabled"]:
        rows += [
            ("fleet", "up" if s["fleet_up"] else "not answering"),
            ("fleet lookups", s["fleet_lookups"]),
            ("fleet hits", f"{s['fleet_hit_blocks']} blocks, {format_size(s['fleet_bytes_fetched'])}"),
            ("fleet promoted", f"{s['fleet_promoted_blocks']} blocks"),
            ("fleet written", f"{s['fleet_blocks_written']} blocks, {format_size(s['fleet_bytes_written'])}"),
            ("fleet backlog", f"{s['fleet_backlog_blocks']} blocks, {format_size(s['fleet_backlog_bytes'])}"),
            ("fleet dropped", s["fleet_dropped"]),
            ("fleet skipped", s["fleet_skipped"]),
            ("fleet errors", s["fleet_errors"]),
            ("fleet corrupt", s["fleet_corrupt"]),
        ]
    else:
        rows.append(("fleet", "off"))
    print(format_table(rows))
    return 0


def cmd_ls(client: KVStoreClient, args: argparse.Namespace) -> int:
    # One block past the limit tells whether there are more.
    want = args.limit + 1 if args.limit else None
    blocks = client.iter_blocks(args.namespace, page_size=min(want or PAGE_SIZE, PAGE_SIZE))
    shown = list(islice(blocks, want))
    more = want is not None and len(shown) == want
    shown = shown[: args.limit or None]
    if args.json:
        _emit_json([_block_json(b) for b in shown])
        return 0
    if not shown:
        print("no blocks stored")
        return 0
    now = time.time()
    rows = [
        (
            render_namespace(b.namespace),
            short_hash(b.block_hash),
            format_size(b.size_bytes),
            b.num_children,
            _ago(now, b.last_access_at),
            format_timestamp(b.created_at),
        )
        for b in shown
    ]
    print(format_table(rows, LS_HEADERS, right={2, 3}))
    if more:
        print(f"(first {args.limit} blocks shown; --limit N for more, 0 for all)", file=sys.stderr)
    return 0


def _resolve_block(client: KVStoreClient, namespace: bytes, given: str) -> bytes:
    """The block hash `given` names in `namespace`: all 64 digits as they are (no call), or
    the one stored block whose hash starts with the prefix, found by listing the namespace
    in hash order (paged; it stops past the prefix). Raises Failure when no block or more
    than one has it."""
    if len(given) == HASH_HEX_DIGITS:
        return bytes.fromhex(given)
    matches: list[bytes] = []
    for block in client.iter_blocks(namespace, page_size=PAGE_SIZE):
        digits = block.block_hash.hex()
        if digits.startswith(given):
            matches.append(block.block_hash)
            if len(matches) > PREFIX_CANDIDATES_SHOWN:
                break
        elif digits > given:  # listed in hash order: no later block starts with it
            break
    if len(matches) == 1:
        return matches[0]
    where = f"namespace {shell_namespace(namespace)}"
    if not matches:
        if not client.list_blocks(namespace, limit=1)[0]:
            raise Failure(missing_namespace_hint(namespace, client.namespaces()))
        raise Failure(f"no block in {where} has a hash starting with {given}")
    width = SHORT_HASH_DIGITS if len(given) < SHORT_HASH_DIGITS else HASH_HEX_DIGITS
    shown = [h.hex()[:width] for h in matches[:PREFIX_CANDIDATES_SHOWN]]
    more = ", and more" if len(matches) > PREFIX_CANDIDATES_SHOWN else ""
    raise Failure(
        f"the hash prefix {given} names several blocks in {where}: {', '.join(shown)}{more}; give more digits"
    )


def cmd_show(client: KVStoreClient, args: argparse.Namespace) -> int:
    resp = client.describe(args.namespace, _resolve_block(client, args.namespace, args.hash))
    block = resp.block
    layers = [
        {
            "name": layer.spec.name,
            "dtype": layer.spec.dtype,
            "shape": list(layer.spec.shape),
            "nbytes": layer.nbytes,
            "checksum": f"{layer.checksum:016x}",
        }
        for layer in resp.layers
    ]
    if args.json:
        _emit_json({**_block_json(block), "num_layers": block.num_layers, "layers": layers})
        return 0
    now = time.time()
    fields = [
        ("namespace", render_namespace(block.namespace)),
        ("hash", block.block_hash.hex()),
        ("parent", block.parent_hash.hex() or "- (first block of its chain)"),
        ("size", f"{format_size(block.size_bytes)} ({block.size_bytes} bytes)"),
        ("layers", block.num_layers),
        ("children", block.num_children),
        ("created", f"{format_timestamp(block.created_at)} ({_ago(now, block.created_at)})"),
        ("last access", f"{format_timestamp(block.last_access_at)} ({_ago(now, block.last_access_at)})"),
    ]
    print(format_table(fields))
    print()
    rows = [
        (la["name"], la["dtype"], str(la["shape"]), format_size(la["nbytes"]), la["checksum"])
        for la in layers
    ]
    print(format_table(rows, LAYER_HEADERS, right={3}))
    return 0


def _evict_selector(args: argparse.Namespace) -> dict[str, Any]:
    """The one selector given, as KVStoreClient.evict keyword arguments."""
    if args.block is not None and args.namespace is None:
        raise UsageError("--block needs --namespace")
    candidates = {
        "--all": {"all": True} if args.all else None,
        "--block": {"namespace": args.namespace, "block_hash": args.block}
        if args.block is not None
        else None,
        "--namespace": {"namespace": args.namespace}
        if args.namespace is not None and args.block is None
        else None,
        "--older-than": {"older_than": args.older_than} if args.older_than is not None else None,
        "--down-to": {"target_bytes": args.down_to} if args.down_to is not None else None,
    }
    given = {flag: kwargs for flag, kwargs in candidates.items() if kwargs is not None}
    if len(given) != 1:
        got = f" (got {', '.join(given)})" if given else ""
        raise UsageError(f"give exactly one of {', '.join(candidates)}{got}")
    return next(iter(given.values()))


def _confirm(question: str) -> bool:
    """Ask on stderr (stdout may be JSON), read the answer from stdin; default no."""
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def cmd_evict(client: KVStoreClient, args: argparse.Namespace) -> int:
    selector = _evict_selector(args)
    if "block_hash" in selector:
        selector["block_hash"] = _resolve_block(client, args.namespace, selector["block_hash"])
    if args.all and not args.yes:
        if not sys.stdin.isatty():
            _error("refusing to evict every block: stdin is not a terminal; pass --yes to confirm")
            return 1
        if not _confirm("Evict every block?"):
            _error("nothing evicted")
            return 1
    if args.fleet and not ("all" in selector or set(selector) == {"namespace"}):
        raise UsageError("--fleet goes with --namespace or --all")
    result = client.evict(**selector, fleet=args.fleet)
    if args.json:
        out = {"blocks_evicted": result.blocks_evicted, "bytes_freed": result.bytes_freed}
        if args.fleet:
            out["fleet_objects_removed"] = result.fleet_objects_removed
        _emit_json(out)
    else:
        noun = "block" if result.blocks_evicted == 1 else "blocks"
        line = f"evicted {result.blocks_evicted} {noun}, freed {format_size(result.bytes_freed)}"
        if args.fleet:
            line += f"; removed {result.fleet_objects_removed} objects from the fleet"
        print(line)
    if set(selector) == {"namespace"} and not result.blocks_evicted and not result.fleet_objects_removed:
        # nothing of it was stored: most likely a typo, or a connector namespace without its
        # |ppRofN (exit 1, so a script notices)
        _error(missing_namespace_hint(args.namespace, client.namespaces()))
        return 1
    return 0


def _event_json(event: Event) -> dict[str, Any]:
    return {
        "sequence": event.sequence,
        "kind": event.kind,
        "namespace": render_namespace(event.namespace),
        "block_hashes": [h.hex() for h in event.block_hashes],
        "parent_hashes": [h.hex() for h in event.parent_hashes],
        "timestamp": event.timestamp,
        "store_id": event.store_id,
    }


def _event_line(event: Event) -> str:
    hashes = event.block_hashes
    count = f"{len(hashes)} block" + ("" if len(hashes) == 1 else "s")
    span = "-"
    if hashes:
        span = short_hash(hashes[0]) + (f"..{short_hash(hashes[-1])}" if len(hashes) > 1 else "")
    return "  ".join(
        (str(event.sequence), format_timestamp(event.timestamp), f"{event.kind:<7}",
         render_namespace(event.namespace), count, span)
    )  # fmt: skip


def cmd_watch(client: KVStoreClient, args: argparse.Namespace) -> int:
    seen = 0
    with client.watch(args.from_sequence, args.namespace) as stream:
        # Ctrl-C (or SIGTERM) ends the watch quietly, exit 0: the handler cancels the stream
        # from another thread. NOTE: not KeyboardInterrupt: raised inside gRPC's iterator,
        # it could leave the call's lock held, and the cancel on the way out then hung.
        def stop(signum: int, frame: object) -> None:
            threading.Thread(target=stream.cancel, name="kvstore-cli-stop", daemon=True).start()

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            if not args.json:
                print(
                    f"watching {args.address} (store {stream.store_id}, "
                    f"from sequence {stream.start_sequence}); Ctrl-C to stop",
                    file=sys.stderr,
                    flush=True,
                )
            for event in stream:
                print(json.dumps(_event_json(event)) if args.json else _event_line(event), flush=True)
                seen += 1
                if args.count and seen >= args.count:
                    break
        except StoreUnavailable as exc:  # not unreachable: it was there and is going away
            _error(f"the watch ended after {seen} events: {exc}")
            return 1
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return 0


def _read_prompt(path: str | None) -> tuple[str, str]:
    """(text, where) of the token ids: FILE, or stdin for None or '-'."""
    if path is None or path == "-":
        if sys.stdin.isatty():
            print("reading token ids from stdin (end with Ctrl-D)", file=sys.stderr, flush=True)
        return sys.stdin.read(), "stdin"
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None


def cmd_explain(client: KVStoreClient, args: argparse.Namespace) -> int:
    text, where = _read_prompt(args.file)
    try:
        tokens = parse_token_ids(text)
    except ValueError as exc:
        raise UsageError(f"{where}: {exc}") from None
    namespace: bytes = args.namespace
    derived_root = connector_hash_root(namespace)
    # a connector namespace pasted without its |ppRofN hashes as its first stage's would
    staged = namespace if derived_root is not None else namespace + b"|pp0of1"
    root = args.hash_root if args.hash_root is not None else (connector_hash_root(staged) or namespace)
    connector_size = connector_block_size(staged)
    block_size = args.block_size or connector_size or DEFAULT_EXPLAIN_BLOCK_SIZE
    if args.block_size:
        size_from = "from --block-size"
    elif connector_size:
        size_from = "the connector namespace's bsN"
    else:
        size_from = "the default"
    hashes = block_hashes(root, tokens, block_size, cache_salt=args.cache_salt, lora_name=args.lora)
    hit = client.lookup(namespace, hashes) if hashes else 0
    statuses = [HIT] * hit
    if hit < len(hashes):
        statuses.append(MISS)
        # one-block lookups: which blocks past the break are stored all the same
        statuses += [UNREACHABLE if client.lookup(namespace, [h]) else MISSING for h in hashes[hit + 1 :]]
    hints = _explain_hints(client, namespace, len(tokens), statuses, block_size, size_from)
    # vLLM computes at least the prompt's last token: a prompt that is all whole,
    # stored blocks reuses one block less.
    max_reusable = (len(tokens) - 1) // block_size
    reusable = min(hit, max_reusable)
    blocks = [
        {
            "index": i,
            "first_token": i * block_size,
            "last_token": (i + 1) * block_size - 1,
            "hash": h.hex(),
            "status": status,
        }
        for i, (h, status) in enumerate(zip(hashes, statuses, strict=True))
    ]
    if args.json:
        _emit_json(
            {
                "namespace": render_namespace(namespace),
                "hash_root": render_namespace(root),
                "block_size": block_size,
                "num_tokens": len(tokens),
                "full_blocks": len(hashes),
                "hit_blocks": hit,
                "break_at": hit if hit < len(hashes) else None,
                "max_reusable_blocks": max_reusable,
                "reusable_blocks": reusable,
                "reusable_tokens": reusable * block_size,
                "blocks": blocks,
                "hints": hints,
            }
        )
        return 0
    partial = len(tokens) % block_size
    root_note = ""
    if args.hash_root is None and derived_root is not None:
        root_note = " (vLLM connector namespace: the stage suffix is not part of the root)"
    fields = [
        ("namespace", render_namespace(namespace)),
        ("hash root", render_namespace(root) + root_note),
        ("block size", block_size),
        ("tokens", f"{len(tokens)}: {len(hashes)} full blocks"
                   + (f" + {partial} in a partial block, never stored" if partial else "")),
    ]  # fmt: skip
    print(format_table(fields))
    if blocks:
        print()
        rows = [
            (i, f"{i * block_size}-{(i + 1) * block_size - 1}", short_hash(h), _STATUS_TEXT[status])
            for i, (h, status) in enumerate(zip(hashes, statuses, strict=True))
        ]
        print(format_table(rows, EXPLAIN_HEADERS, right={0}))
    print()
    summary = f"{hit} of {len(hashes)} full blocks hit = {reusable * block_size} tokens reusable"
    if reusable < hit:
        noun = "block" if reusable == 1 else "blocks"
        summary += f" ({reusable} {noun}: a prompt reuses at most the blocks that leave one token to compute)"
    print(summary)
    for hint in hints:
        print(f"hint: {hint}")
    return 0


def _explain_hints(
    client: KVStoreClient, namespace: bytes, num_tokens: int, statuses: list[str], block_size: int,
    size_from: str,
) -> list[str]:  # fmt: skip
    """Why no block of the prompt is stored, when none is (hit or behind the break): the
    namespace holds no blocks (and which it may have meant), or it does and the prompt
    fills no block, or its blocks were hashed otherwise than the writer's (most often:
    another block size)."""
    if any(status in (HIT, UNREACHABLE) for status in statuses):
        return []
    if not client.list_blocks(namespace, limit=1)[0]:
        return [missing_namespace_hint(namespace, client.namespaces())]
    if not statuses:
        return [
            f"the prompt's {num_tokens} tokens fill no block of {block_size} tokens ({size_from}; "
            "--block-size N sets it): only full blocks are stored"
        ]
    return [
        f"none of the prompt's {len(statuses)} blocks is stored, but namespace "
        f"{shell_namespace(namespace)} holds blocks: were they stored with another block size? "
        f"this used {block_size} tokens per block ({size_from}; --block-size N sets it). "
        "Else the hash root, cache salt or LoRA differ from the writer's"
    ]


# ---- command line ------------------------------------------------------------------
def _checked(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """An argparse type from a parser that raises ValueError with a readable message."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name
    return convert


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be a positive number of seconds, not {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must not be negative, not {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be a positive integer, not {text!r}")
    return value


_NAMESPACE = _checked(parse_namespace, "namespace")
_HASH = _checked(parse_hash_prefix, "hash")


def _global_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", metavar="HOST:PORT", help=f"default $KVSTORE_ADDRESS or {DEFAULT_ADDRESS}"
    )
    parser.add_argument(
        "--timeout",
        metavar="S",
        type=_checked(_positive_float, "timeout"),
        help=f"deadline of each call in seconds (default {DEFAULT_TIMEOUT:g})",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable JSON output")
    parser.add_argument("--token", metavar="TOKEN", help="bearer token (default $KVSTORE_TOKEN)")
    parser.add_argument(
        "--tls-ca", metavar="PEM", help="CA bundle: connect with TLS (default $KVSTORE_TLS_CA, if set)"
    )
    parser.add_argument("--tls-cert", metavar="PEM", help="client certificate, for mutual TLS")
    parser.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect and manage a kvstore daemon.",
        epilog="Exit status: 0 ok; 1 error or not SERVING; 2 usage error or daemon unreachable.",
    )
    _global_options(parser)
    parser.set_defaults(
        address=os.environ.get("KVSTORE_ADDRESS") or DEFAULT_ADDRESS,
        timeout=DEFAULT_TIMEOUT,
        token=os.environ.get("KVSTORE_TOKEN") or None,
        tls_ca=os.environ.get("KVSTORE_TLS_CA") or None,
        tls_cert=None,
        tls_key=None,
    )
    # The same options after the command; SUPPRESS keeps the values given before it.
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    _global_options(common)
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    def command(name: str, run: Command, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help, description=help)
        p.set_defaults(run=run, subparser=p)
        return p

    command("health", cmd_health, "health of the daemon: SERVING or NOT_SERVING")
    command("stats", cmd_stats, "blocks, bytes used of capacity, uptime and counters")

    ls = command("ls", cmd_ls, "list stored blocks in (namespace, hash) order")
    ls.add_argument("--namespace", type=_NAMESPACE, help="only this namespace (text or 0xHEX)")
    ls.add_argument(
        "--limit",
        metavar="N",
        type=_checked(_non_negative_int, "limit"),
        default=DEFAULT_LIMIT,
        help="at most N blocks (default %(default)s; 0 for all)",
    )

    show = command("show", cmd_show, "describe one block and its layers")
    show.add_argument(
        "hash", metavar="HASH", type=_HASH, help="block hash: 64 hex digits, or a unique prefix of 4 or more"
    )
    show.add_argument("--namespace", type=_NAMESPACE, required=True, help="its namespace (text or 0xHEX)")

    evict = command("evict", cmd_evict, "evict blocks by exactly one selector")
    evict.add_argument("--all", action="store_true", help="every block (asks first unless --yes)")
    evict.add_argument("--namespace", type=_NAMESPACE, help="every block of NS; with --block, its namespace")
    evict.add_argument(
        "--block",
        metavar="HASH",
        type=_HASH,
        help="this block (a hash or a unique prefix) and its descendants",
    )
    evict.add_argument(
        "--older-than",
        metavar="DURATION",
        type=_checked(parse_duration, "duration"),
        help="blocks last used longer ago than DURATION: 90s, 15m, 2h, 7d or seconds",
    )
    evict.add_argument(
        "--down-to",
        metavar="SIZE",
        type=_checked(parse_size, "size"),
        help="least recently used chain tails until at most SIZE is used (e.g. 10GiB)",
    )
    evict.add_argument("-y", "--yes", action="store_true", help="do not ask before --all")
    evict.add_argument(
        "--fleet", action="store_true", help="with --namespace or --all: remove them from the fleet tier too"
    )

    watch = command("watch", cmd_watch, "print stored/removed events as they happen, until Ctrl-C")
    watch.add_argument(
        "--from",
        dest="from_sequence",
        metavar="SEQ",
        type=_checked(_non_negative_int, "sequence"),
        default=0,
        help="replay from event sequence SEQ, if the daemon still holds it (default: only new events)",
    )
    watch.add_argument("--namespace", type=_NAMESPACE, help="only events of this namespace (text or 0xHEX)")
    watch.add_argument(
        "--count",
        metavar="N",
        type=_checked(_non_negative_int, "count"),
        default=0,
        help="exit after N events (default 0: run until interrupted)",
    )

    explain = command(
        "explain", cmd_explain, "which blocks of a prompt are stored, where its chain breaks, tokens reusable"
    )
    explain.add_argument(
        "file",
        metavar="FILE",
        nargs="?",
        help="the prompt's token ids, whitespace/comma separated or a JSON list (default: stdin)",
    )
    explain.add_argument(
        "--namespace", type=_NAMESPACE, required=True, help="the namespace looked up (text or 0xHEX)"
    )
    explain.add_argument(
        "--block-size",
        metavar="N",
        type=_checked(_positive_int, "block size"),
        help=f"tokens per block (default: the bsN of a vLLM connector namespace, "
        f"else {DEFAULT_EXPLAIN_BLOCK_SIZE})",
    )
    explain.add_argument(
        "--hash-root",
        metavar="ROOT",
        type=_NAMESPACE,
        help="chain root of the block hashes (default: the namespace; for a vLLM connector "
        "namespace, the namespace without its |tpNofM|ppNofM suffix)",
    )
    explain.add_argument("--cache-salt", metavar="SALT", help="the request's cache salt, if it had one")
    explain.add_argument("--lora", metavar="NAME", help="the request's LoRA adapter name, if it had one")
    arenas_command.add_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        # `--down-to -1GiB` reaches parse_size, which says what is wrong with it
        args = parser.parse_args(attach_values(sys.argv[1:] if argv is None else argv, VALUE_FLAGS))
    except SystemExit as exc:  # --help, or a usage error (2)
        return int(exc.code or 0)
    if getattr(args, "local", None) is not None:  # a command on this host's files, no daemon
        return int(args.local(args))
    try:
        args.address = with_default_port(args.address)  # the daemon's port, not gRPC's 443
    except ValueError as exc:
        parser.print_usage(sys.stderr)
        _error(f"error: --address: {exc}")
        return 2
    try:
        client = KVStoreClient(
            args.address,
            timeout=args.timeout,
            token=args.token,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        )
    except (OSError, ValueError) as exc:  # unreadable PEM files, cert without key
        _error(f"cannot set up the connection: {exc}")
        return 2
    try:
        with client:
            return int(args.run(client, args))
    except UsageError as exc:
        args.subparser.print_usage(sys.stderr)
        print(f"{args.subparser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except StoreUnavailable as exc:
        _error(f"the kvstore daemon at {args.address} is unreachable: {exc}")
        return 2
    except Failure as exc:
        _error(str(exc))
        return 1
    except KVStoreError as exc:
        _error(f"error: {exc}")
        return 1
    except BrokenPipeError:
        # Output piped into e.g. `head`, which stopped reading: finish quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
