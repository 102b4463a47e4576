"""What one rank's view of a folder means, from what ``stat``, ``mkdir`` and a listing say.

:func:`view_of` is the one decision (pure); :func:`look`, :func:`make` and
:func:`nearest_dir` ask the filesystem. An NFS client may answer ``stat``
from its negative lookup cache (``ENOENT``) while ``mkdir`` asks the server
(``EEXIST``): that folder exists, it is just not visible here yet.
See docs/checkpoint.md#folders-a-filesystem-shows-late.
"""

from __future__ import annotations

import errno
import os
import stat as stat_module

__all__ = [
    "ABSENT",
    "BLOCKED",
    "HIDDEN",
    "VISIBLE",
    "look",
    "make",
    "nearest_dir",
    "stat_result",
    "view_of",
]

#: Nothing there (as far as anything this rank asked can tell).
ABSENT = "absent"
#: There (the server says so: ``mkdir`` found it, or the parent lists it), not yet visible here.
HIDDEN = "hidden"
#: ``stat`` shows a directory.
VISIBLE = "visible"
#: Something that is not a directory is in the way (a successful ``stat`` says so, or the
#: server refuses ``mkdir`` with ``ENOTDIR``).
BLOCKED = "blocked"


def view_of(stat: str, mkdir: str | None = None, listed: bool | None = None) -> str:
    """What a folder is from one rank, given what each lookup said.

    Args:
        stat: ``os.stat(path)``: ``"dir"``, ``"other"`` (it succeeded on something that is
            not a directory), or the errno name it raised (``"ENOENT"``, ``"ENOTDIR"``,
            ``"ESTALE"``...).
        mkdir: ``os.makedirs(path)``: ``"created"``, the errno name it raised (``"EEXIST"``,
            ``"ENOENT"``, ``"ENOTDIR"``, ``"EACCES"``...), or ``None`` (not tried).
        listed: Whether the parent's listing holds the name; ``None``: not listed.

    Returns:
        :data:`VISIBLE`, :data:`HIDDEN`, :data:`ABSENT` or :data:`BLOCKED`. Only a
        successful lookup of a non-directory, or the server's ``ENOTDIR``, is
        :data:`BLOCKED`; a lookup that found nothing never is.
    """
    if stat == "dir" or mkdir == "created":
        return VISIBLE
    if stat == "other":
        return BLOCKED
    if mkdir == "EEXIST":  # the server has it; this client does not show it (yet)
        return HIDDEN
    if mkdir == "ENOTDIR" or (stat == "ENOTDIR" and mkdir is None and not listed):
        return BLOCKED  # an ancestor is not a directory
    return HIDDEN if listed else ABSENT


def stat_result(path: str) -> str:
    """``os.stat(path)`` as :func:`view_of` takes it; a dangling symlink is ``"other"``."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        failed = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
        try:  # a link whose target is missing: found, and in the way
            return "other" if stat_module.S_ISLNK(os.lstat(path).st_mode) else failed
        except OSError:
            return failed
    return "dir" if stat_module.S_ISDIR(mode) else "other"


def _listed(path: str) -> bool | None:
    try:
        return os.path.basename(path) in os.listdir(os.path.dirname(path) or ".")
    except OSError:
        return None


def look(path: str) -> str:
    """This rank's view of ``path`` without creating anything (``stat``, then a listing)."""
    stat = stat_result(path)
    if stat in ("dir", "other"):
        return view_of(stat)
    return view_of(stat, listed=_listed(path))


def make(path: str) -> tuple[str, str | None]:
    """Creates ``path`` (and its parents) unless the server has it; returns the view and why not.

    Returns:
        ``(view, error)``: ``error`` says why creation failed where the folder is not
        there (``view`` :data:`ABSENT` or :data:`BLOCKED`), else ``None``.
    """
    stat = stat_result(path)
    if stat in ("dir", "other"):
        return view_of(stat), (None if stat == "dir" else "not a directory")
    mkdir, failure = "created", ""
    try:
        os.makedirs(path)
    except OSError as exc:
        mkdir = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
        failure = f"{type(exc).__name__}: {exc}"
    view = view_of(stat, mkdir, _listed(path) if mkdir != "created" else None)
    return view, (failure if view in (ABSENT, BLOCKED) else None)


def nearest_dir(path: str) -> tuple[str, str]:
    """The view of absolute ``path`` and its nearest ancestor-or-self that ``stat`` shows.

    Returns:
        ``(view, existing)``: ``existing`` is ``path`` itself when :data:`VISIBLE`;
        the view is :data:`BLOCKED` when what ``stat`` finds first is not a directory.
    """
    view = look(path)
    existing = path
    while stat_result(existing) not in ("dir", "other") and existing != os.path.dirname(existing):
        existing = os.path.dirname(existing)
    if view == ABSENT and stat_result(existing) == "other":
        view = BLOCKED
    return view, existing
