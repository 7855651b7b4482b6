"""`kvstore-cli arenas`: the arena files in a memory directory, and orphans removed.

Runs on the daemon's host and reads the memory directory itself (no daemon needed:
the point is often that it is dead). See kvstore.arenas for what live, recoverable,
orphan and unowned mean.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvstore import arenas
from kvstore.sizes import format_size
from kvstore_cli.formatting import format_table

DEFAULT_MEMORY_DIR = Path("/dev/shm")
HEADERS = ("ARENA", "SIZE", "STATE", "OWNER", "WHY")


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "arenas",
        help="list the memory tier's arena files in a memory directory; remove orphans",
        description="List the arena files in a memory directory (live, recoverable, orphan, "
        "unowned) and, with --remove-orphans, remove the orphans. Runs locally, on the daemon's "
        "host; no daemon is contacted.",
    )
    p.add_argument(
        "--memory-dir",
        type=Path,
        default=DEFAULT_MEMORY_DIR,
        help=f"the daemons' --memory-dir (default {DEFAULT_MEMORY_DIR})",
    )
    p.add_argument(
        "--remove-orphans",
        action="store_true",
        help="remove arenas whose data directory is gone or claims another arena, and that no "
        "live daemon holds",
    )
    p.add_argument(
        "--include-unowned",
        action="store_true",
        help="with --remove-orphans: also remove arenas made by kvstore versions that did not record "
        "their owner, when no daemon holds them",
    )
    p.add_argument("--json", action="store_true", help="machine-readable JSON output")
    p.set_defaults(local=run, subparser=p)


def _row(info: arenas.ArenaInfo) -> tuple[str, ...]:
    return (info.path.name, format_size(info.size), info.state, info.owner or "-", info.reason)


def _doc(info: arenas.ArenaInfo) -> dict[str, object]:
    return {
        "path": str(info.path),
        "size_bytes": info.size,
        "state": info.state,
        "owner": info.owner,
        "reason": info.reason,
        "holders": info.holders,
    }


def run(args: argparse.Namespace) -> int:
    if not args.memory_dir.is_dir():
        print(f"kvstore-cli: {args.memory_dir} is not a directory", file=sys.stderr)
        return 2
    if args.include_unowned and not args.remove_orphans:
        print("kvstore-cli arenas: --include-unowned goes with --remove-orphans", file=sys.stderr)
        return 2
    removed: list[arenas.ArenaInfo] = []
    if args.remove_orphans:
        try:
            removed = arenas.remove_orphans(args.memory_dir, include_unowned=args.include_unowned)
        except PermissionError as exc:
            print(f"kvstore-cli: cannot remove arenas in {args.memory_dir}: {exc}", file=sys.stderr)
            return 1
    remaining = arenas.scan(args.memory_dir)
    if args.json:
        print(
            json.dumps(
                {"removed": [_doc(i) for i in removed], "arenas": [_doc(i) for i in remaining]}, indent=2
            )
        )
        return 0
    for info in removed:
        print(f"removed {info.path} ({format_size(info.size)}): {info.reason}")
    if remaining:
        print(format_table([_row(i) for i in remaining], HEADERS, right=(1,)))
    elif not removed:
        print(f"no arenas in {args.memory_dir}")
    orphans = [i for i in remaining if i.state == arenas.ORPHAN]
    if orphans and not args.remove_orphans:
        total = sum(i.size for i in orphans)
        print(
            f"{len(orphans)} orphaned arena(s) hold {format_size(total)}: "
            f"kvstore-cli arenas --memory-dir {args.memory_dir} --remove-orphans"
        )
    return 0
