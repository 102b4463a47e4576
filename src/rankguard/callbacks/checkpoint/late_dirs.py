"""Words for a folder that some rank saw late: the mount options that cause it, and the fix.

Pure; :class:`~rankguard.callbacks.checkpoint.shared_dirs_plan.BarrierPlanner` calls
:func:`late_warning` with what each rank reported (its filesystem and mount from
``/proc/mounts``). See docs/checkpoint.md#folders-a-filesystem-shows-late.
"""

from __future__ import annotations

from rankguard.callbacks.core.ranks import rank_label

__all__ = ["CACHE_OPTIONS", "cache_options", "late_warning"]

#: NFS mount options that decide how long a client may hide a folder another node made.
CACHE_OPTIONS = ("lookupcache", "actimeo", "acdirmin", "acdirmax", "noac", "ac")
#: Linux NFS client defaults, in force where ``/proc/mounts`` shows none of those.
NFS_DEFAULTS = "acdirmin=30, acdirmax=60, lookupcache=all (the defaults)"


def cache_options(fs: str, mount: str) -> str:
    """The mount's caching options that hide new folders, as a person reads them.

    Args:
        fs: Filesystem type (``nfs4``, ``ext4``...).
        mount: ``"<mount point> <options>"`` from ``/proc/mounts`` (``""`` unknown).

    Returns:
        For NFS, the point and the options in force (or the defaults); for any other
        filesystem, which options to look at.
    """
    point, _, options = mount.partition(" ")
    at = f" at {point}" if point else ""
    if not fs.startswith("nfs"):
        return (
            f"{fs}{at}, not NFS: if it is a network filesystem, look at its client's "
            "attribute and lookup caches (on NFS: `lookupcache`, `actimeo`, `acdirmin`, "
            "`acdirmax`)"
        )
    chosen = [
        o for o in options.split(",") if o and o.partition("=")[0] in CACHE_OPTIONS and o != "rw"
    ]
    return f"{fs}{at} with {', '.join(chosen) if chosen else NFS_DEFAULTS}"


def late_warning(
    path: str,
    lags: dict[int, float],
    hosts: dict[int, str],
    filesystems: dict[int, tuple[str, str]],
    timeout_s: float,
) -> str:
    """The warning for a folder that became visible late on some ranks.

    Args:
        path: The folder (as the late ranks name it).
        lags: Per late rank, how much later than the first rank it saw the folder (s).
        hosts: Per late rank, its node.
        filesystems: Per late rank, ``(fs type, "<mount point> <options>")``.
        timeout_s: The barrier's ``timeout_s``, which a longer lag would exceed.
    """
    worst = max(lags, key=lambda r: lags[r])
    others = sorted(set(lags) - {worst})
    more = f" (and {rank_label(others)})" if others else ""
    fs, mount = filesystems[worst]
    return (
        f"Folder {path} became visible {lags[worst]:.1f} s late on rank {worst} "
        f"({hosts[worst]}){more}. rankguard waited for it, but a client that caches a "
        "failed lookup and directory attributes hides a folder another node made until "
        f"its cache expires: filesystem on rank {worst}: {cache_options(fs, mount)}. "
        f"A longer lag stops the job after `timeout_s` ({timeout_s:g} s; OLMo-core's and "
        "other frameworks' own waits give up sooner). Fix: mount it with "
        "`lookupcache=positive` (or `none`) and short attribute caching (e.g. `actimeo=1`, "
        "or `acdirmin`/`acdirmax`), or save to a filesystem without these caches. Said once "
        "per run."
    )
