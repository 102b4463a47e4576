"""What both adapters share: building guards from callback arguments."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from rankguard.callbacks.guard import Guard
from rankguard.callbacks.registry import GUARDS, build_guard, build_guards, unknown_name_error

__all__ = ["bundle_guards", "class_name", "expose_signatures", "single_guard"]

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


def _bundle_signature() -> inspect.Signature:
    """``RankGuard(exchange_timeout_s=300.0, *, <guard name>: dict | bool = True, ...)``."""
    params = [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter(
            "exchange_timeout_s",
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=300.0,
            annotation=float,
        ),
    ]
    params += [
        inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=True, annotation=dict[str, Any] | bool
        )
        for name in GUARDS
    ]
    return inspect.Signature(params)


def class_name(guard_name: str) -> str:
    """A guard's callback class name in each adapter, e.g. ``BatchParityGuard``."""
    return "".join(part.title() for part in guard_name.split("_"))


def expose_signatures(namespace: Mapping[str, Any]) -> None:
    """Gives an adapter's callbacks, which take ``**kwargs``, the signature of what they accept.

    Config tools that read signatures (LightningCLI's jsonargparse) cannot see
    through ``**kwargs``; the signatures come from the registry and the core
    guards, so they never drift from what the constructors accept.

    Args:
        namespace: The adapter module's globals: ``RankGuard`` and one class per
            registered guard, named by :func:`class_name` (a missing one is a
            ``KeyError`` at import).
    """
    namespace["RankGuard"].__init__.__signature__ = _bundle_signature()
    for name, guard in GUARDS.items():
        init = namespace[class_name(name)].__init__
        init.__signature__ = inspect.signature(guard.__init__, eval_str=True)
