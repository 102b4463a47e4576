"""How much host memory this process may still use: cgroup limit and MemAvailable.

A container or batch scheduler usually caps a job with a memory cgroup; the
OOM killer acts on that cap, not on the machine's free memory. The answer is
therefore the smaller of:

* the cgroup headroom: ``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1)
  minus the memory charged to the cgroup, not counting inactive file pages,
  which the kernel reclaims before it kills (the figure ``docker stats``
  shows);
* ``MemAvailable`` from ``/proc/meminfo``.

Every parser here is pure (text in, number out) so it is tested on sample
text; :func:`host_memory_available` reads the real files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "HostMemory",
    "cgroup_memory_dirs",
    "host_memory_available",
    "parse_cgroup_limit",
    "parse_inactive_file",
    "parse_meminfo",
]

#: Limits at or above this are "unlimited" (cgroup v1 writes 2**63 rounded to a page).
UNLIMITED = 1 << 60


@dataclass(frozen=True)
class HostMemory:
    """Host memory this process may still use.

    Attributes:
        available_bytes: Bytes, or ``None`` when nothing could be read.
        source: Where the number comes from, e.g. ``"cgroup v2 memory.max"``.
    """

    available_bytes: int | None
    source: str


def parse_meminfo(text: str) -> int | None:
    """Returns ``MemAvailable`` in bytes from ``/proc/meminfo`` text, or ``None``."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            return int(fields[1]) * (1024 if fields[-1] == "kB" else 1)
    return None


def parse_cgroup_limit(text: str) -> int | None:
    """Returns a cgroup memory limit in bytes, or ``None`` when unlimited ("max")."""
    value = text.strip()
    if not value or value == "max":
        return None
    limit = int(value)
    return None if limit >= UNLIMITED else limit


def parse_inactive_file(text: str) -> int:
    """Returns inactive file-page bytes from ``memory.stat`` text (v2 or v1 names), else 0."""
    stats = dict(line.split()[:2] for line in text.splitlines() if len(line.split()) >= 2)
    for key in ("inactive_file", "total_inactive_file"):
        if key in stats:
            return int(stats[key])
    return 0


def cgroup_memory_dirs(
    proc_self_cgroup: str, root: str = "/sys/fs/cgroup"
) -> list[tuple[str, str]]:
    """Candidate directories of this process's memory cgroup, best first.

    Args:
        proc_self_cgroup: Text of ``/proc/self/cgroup``.
        root: Where the cgroup filesystem is mounted.

    Returns:
        ``(version, directory)`` pairs, ``version`` ``"v2"`` or ``"v1"``. Inside a
        cgroup namespace the listed path may not exist under ``root``; the
        mount's own root (which is then this process's cgroup) follows it.
    """
    candidates: list[tuple[str, str]] = []
    for line in proc_self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        rel = path.lstrip("/")
        if hierarchy == "0" and controllers == "":
            candidates += [("v2", os.path.join(root, rel)), ("v2", root)]
        elif "memory" in controllers.split(","):
            base = os.path.join(root, "memory")
            candidates += [("v1", os.path.join(base, rel)), ("v1", base)]
    return candidates


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _cgroup_headroom(version: str, directory: str) -> int | None:
    limit_file, usage_file = (
        ("memory.max", "memory.current") if version == "v2" else
        ("memory.limit_in_bytes", "memory.usage_in_bytes")
    )  # fmt: skip
    limit_text = _read(os.path.join(directory, limit_file))
    if limit_text is None:
        return None
    limit = parse_cgroup_limit(limit_text)
    usage_text = _read(os.path.join(directory, usage_file))
    if limit is None or usage_text is None:
        return None
    inactive = parse_inactive_file(_read(os.path.join(directory, "memory.stat")) or "")
    return max(0, limit - max(0, int(usage_text) - inactive))


def host_memory_available(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> HostMemory:
    """Reads how much host memory this process may still use.

    Args:
        proc: Where procfs is mounted.
        cgroup_root: Where the cgroup filesystem is mounted.

    Returns:
        The smaller of the cgroup headroom and ``MemAvailable``, with its source.
    """
    found: list[tuple[int, str]] = []
    meminfo = parse_meminfo(_read(os.path.join(proc, "meminfo")) or "")
    if meminfo is not None:
        found.append((meminfo, "MemAvailable (/proc/meminfo)"))
    for version, directory in cgroup_memory_dirs(
        _read(os.path.join(proc, "self", "cgroup")) or "", cgroup_root
    ):
        headroom = _cgroup_headroom(version, directory)
        if headroom is not None:
            limit = "memory.max" if version == "v2" else "memory.limit_in_bytes"
            found.append((headroom, f"cgroup {version} {limit} minus usage"))
            break
        if os.path.exists(
            os.path.join(directory, "memory.max" if version == "v2" else "memory.limit_in_bytes")
        ):
            break  # this process's cgroup, and it has no limit
    if not found:
        return HostMemory(None, "unknown")
    available, source = min(found)
    return HostMemory(available, source)
