"""What every adapter shares: building guards from callback arguments, and their names.

Every adapter module exports the same names: ``RankGuard`` (every guard) and
one class per registered guard (``BatchParityGuard``, ...), declared once in
``rankguard.integrations._api``; their ``__init__`` builds the guards here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.registry import GUARDS, build_guard, build_guards, unknown_name_error

__all__ = ["Defaults", "bundle_guards", "class_name", "single_guard"]

Defaults = Mapping[str, Mapping[str, Any]]


def _with_defaults(name: str, settings: Any, defaults: Defaults | None) -> Any:
    """The user's settings for guard ``name`` over the framework's defaults for it."""
    if not defaults or name not in defaults or settings is False:
        return settings
    user = settings if isinstance(settings, Mapping) else {}
    return {**defaults[name], **user}


def bundle_guards(
    per_guard_config: Mapping[str, Mapping[str, Any] | bool | None],
    defaults: Defaults | None = None,
) -> list[Guard]:
    """The guards of a ``RankGuard`` callback (every guard unless disabled).

    Args:
        per_guard_config: The user's settings per guard name.
        defaults: The framework's own defaults per guard name, under the user's.
    """
    for name in per_guard_config:
        if name not in GUARDS:  # the bundle's own argument is a valid name too
            raise unknown_name_error("`RankGuard` argument", name, [*GUARDS, "exchange_timeout_s"])
    names = set(per_guard_config) | set(defaults or {})
    config = {
        name: _with_defaults(name, per_guard_config.get(name, True), defaults) for name in names
    }
    return build_guards(config)


def single_guard(
    name: str, settings: Mapping[str, Any], defaults: Defaults | None = None
) -> list[Guard]:
    """The one guard of a single-guard callback such as ``BatchParityGuard``."""
    return [build_guard(GUARDS[name], _with_defaults(name, settings, defaults))]


def class_name(guard_name: str) -> str:
    """A guard's callback class name in each adapter, e.g. ``BatchParityGuard``."""
    return "".join(part.title() for part in guard_name.split("_"))
