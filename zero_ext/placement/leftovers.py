"""State directories a killed process left behind, found and reported (never deleted) by the next optimizer.

The optimizer deletes its state files when it is closed, collected or its process exits; a process killed outright
(SIGKILL, the OOM killer, a node's job scheduler) cannot, and its files, 12 bytes per parameter of its shard, stay
in ``offload_dir`` until someone deletes them. Each rank's directory is named after the host and the process that
made it, so the next optimizer using the same ``offload_dir`` on that host can tell a directory whose process no
longer runs and say so, with its size. It only warns: another job may share the directory from another host, and a
user's files are theirs to delete.
"""

from __future__ import annotations

import os
import re
import socket
import warnings

PATTERN = re.compile(r"^zero_ext-rank(\d+)-([A-Za-z0-9_.]+)-(\d+)-[^-]*$")


def host_tag() -> str:
    """This host's name as it appears in directory names (no '-', which separates the fields)."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def dir_prefix(rank: int) -> str:
    """The prefix of a rank's state directory: ``zero_ext-rank<r>-<host>-<pid>-`` (tempfile adds a random tail)."""
    return f"zero_ext-rank{rank}-{host_tag()}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _allocated_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def find(parent: str) -> list[tuple[str, int, int]]:
    """(path, pid, bytes on disk) of every state directory in ``parent`` made on this host by a process that no
    longer runs."""
    here, out = host_tag(), []
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return out
    for name in names:
        m = PATTERN.match(name)
        path = os.path.join(parent, name)
        if m and m.group(2) == here and not _alive(int(m.group(3))) and os.path.isdir(path):
            out.append((path, int(m.group(3)), _allocated_bytes(path)))
    return out


def warn(parent: str) -> None:
    """A warning naming the leftovers in ``parent`` and their size, if there are any."""
    found = find(parent)
    if not found:
        return
    total = sum(size for _, _, size in found)
    pids = sorted({pid for _, pid, _ in found})
    shown = ", ".join(path for path, _, _ in found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    warnings.warn(
        f"zero_ext.ZeroAdamW: offload_dir {parent!r} holds {total / 2**30:.2f} GiB of optimizer state files left by "
        f"process(es) {pids} of this host, which no longer run (killed before they could delete them): {shown}. "
        "They are never loaded back (resume from a checkpoint); delete them to free the disk.",
        stacklevel=4,
    )
