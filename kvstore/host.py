"""Facts about this process's host that the daemon and its same-host clients compare."""

from __future__ import annotations

import os


def pid_namespace() -> str:
    """This process's PID namespace ("pid:[4026531836]" on Linux), or "" where there is none."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
