"""What one rank can see of a directory: path state, filesystem, markers.

The pure, per-rank half of :mod:`~rankguard.callbacks.checkpoint.shared_dir_barrier`; nothing
here talks to other ranks. Which node the rank is on is
:func:`~rankguard.callbacks.core.nodes.node_identity`.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

from rankguard.callbacks.checkpoint.dir_view import nearest_dir

__all__ = [
    "MARKER_PREFIX",
    "Marker",
    "Mount",
    "PathState",
    "filesystem_type",
    "inspect_path",
    "marker_seen",
    "mount_of",
    "name_below",
    "write_marker",
]

#: Marker files are named ``MARKER_PREFIX + nonce``; a fresh name is never in a
#: client's negative lookup cache, so a shared filesystem shows it at once.
MARKER_PREFIX = ".rankguard-probe-"


@dataclass(frozen=True)
class PathState:
    """One directory as one rank sees it.

    Attributes:
        path: Absolute path (relative paths are resolved against this rank's cwd).
        state: Its view here (:func:`~rankguard.callbacks.checkpoint.dir_view.view_of`):
            ``"visible"``, ``"hidden"`` (there, not yet visible here), ``"absent"`` or
            ``"blocked"`` (something that is not a directory is in the way).
        existing: The nearest ancestor-or-self this rank sees.
        fs: Filesystem type of ``existing`` from ``/proc/mounts``.
        mount: That filesystem's mount point and options (``"/mnt/ckpt rw,actimeo=60"``).
    """

    path: str
    state: str
    existing: str
    fs: str
    mount: str = ""


@dataclass(frozen=True)
class Mount:
    """The ``/proc/mounts`` line of the mount that holds a path."""

    point: str
    fstype: str
    options: str


def _unescape(field: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_of(path: str, mounts_text: str) -> Mount:
    """The mount holding ``path``: the longest mount point that contains it.

    Args:
        path: An absolute, symlink-free path.
        mounts_text: Text of ``/proc/mounts``.

    Returns:
        Its point, type and options (``Mount("", "unknown", "")`` if none).
    """
    best, found = -1, Mount("", "unknown", "")
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = _unescape(fields[1]).rstrip("/") or "/"
        inside = path == mount or path.startswith(mount if mount == "/" else mount + "/")
        if inside and len(mount) >= best:  # later mounts over the same point win
            options = fields[3] if len(fields) > 3 else ""
            best, found = len(mount), Mount(mount, fields[2], options)
    return found


def filesystem_type(path: str, mounts_text: str) -> str:
    """Returns the type (``nfs``, ``lustre``, ``ext4``...) of the mount holding ``path``."""
    return mount_of(path, mounts_text).fstype


def _mounts() -> str:
    try:
        with open("/proc/mounts") as f:
            return f.read()
    except OSError:
        return ""


def inspect_path(path: str) -> PathState:
    """Resolves ``path`` against this rank's cwd and says what is there, as this rank sees it."""
    absolute = os.path.abspath(path)
    view, existing = nearest_dir(absolute)
    mount = mount_of(os.path.realpath(existing), _mounts())
    options = f"{mount.point} {mount.options}".strip()
    return PathState(absolute, view, existing, mount.fstype, options)


@dataclass(frozen=True)
class Marker:
    """A marker file rank 0 wrote ``levels`` directories above a target path."""

    levels: int
    name: str
    nonce: str


def _up(path: str, levels: int) -> str:
    for _ in range(levels):
        path = os.path.dirname(path)
    return path


def write_marker(state: PathState) -> tuple[Marker, str]:
    """Writes a fresh marker in the nearest existing ancestor-or-self of ``state.path``.

    Returns:
        The marker and the file written (the caller removes it).

    Raises:
        OSError: The directory is not writable.
    """
    nonce = secrets.token_hex(8)
    name = MARKER_PREFIX + nonce
    levels = 0
    while _up(state.path, levels) != state.existing:
        levels += 1
    file = os.path.join(state.existing, name)
    with open(file, "x") as f:  # "x": never overwrite anything
        f.write(nonce)
    return Marker(levels, name, nonce), file


def name_below(path: str, levels: int) -> str:
    """The part of ``path`` below its ancestor ``levels`` up (a marker's directory).

    Ranks that see the same marker share that directory, so the same name
    below it is the same folder for them, and a different name (``rank0``,
    ``rank1``) a different folder.
    """
    return os.path.relpath(path, _up(path, levels))


def marker_seen(path: str, marker: Marker) -> bool:
    """Whether this rank sees ``marker`` at the same place above its own ``path``."""
    try:
        with open(os.path.join(_up(path, marker.levels), marker.name)) as f:
            return f.read() == marker.nonce
    except OSError:
        return False
