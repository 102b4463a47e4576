"""What every adapter shares: building guards from callback arguments, and its public classes.

Every adapter module exports the same names: ``RankGuard`` (every guard) and
one class per registered guard (``BatchParityGuard``, ...). They differ only
in the adapter base class they extend. ``tools/generate_api.py`` writes them
into each adapter module from the registry, with their settings in their
signatures for editors and type checkers; :func:`bundle_init` and
:func:`guard_init` give them the ``__init__`` that runs, whose
``inspect.signature`` config tools such as LightningCLI's jsonargparse read.
``tests/integrations/test_api.py`` fails when the written classes no longer match the registry.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.registry import GUARDS, build_guard, build_guards, unknown_name_error

__all__ = ["bundle_guards", "bundle_init", "class_name", "guard_init", "single_guard"]

Defaults = Mapping[str, Mapping[str, Any]]

#: ``RankGuard``'s docstring; ``{kind}`` says what it is in the adapter's framework.
BUNDLE_DOC = """Every rankguard guard with sound defaults, as {kind}.

    Args:
        exchange_timeout_s: How long a cross-rank check waits for every rank
            before naming the ones that did not arrive (seconds; grows by 5 ms
            per rank with the world size, see ``docs/scale.md``). The hang
            watchdog's own exchanges use its settings.
        **per_guard_config: Per guard, by snake-case name, a dict of its
            settings or ``False`` to leave it out, e.g.
            ``RankGuard(batch_parity_guard={{"on_violation": "warn"}}, drop_last_guard=False)``.
    """


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


_Init = TypeVar("_Init", bound=Callable[..., None])


def _declared_as(init: Callable[..., None], declared: Callable[..., None], signature: Any) -> None:
    """Gives ``init`` the declaration's name and docstring, and the signature tools read."""
    init.__signature__ = signature  # type: ignore[attr-defined]
    init.__qualname__ = declared.__qualname__
    init.__doc__ = declared.__doc__


def bundle_init(base: type[Any], defaults: Defaults | None = None) -> Callable[[_Init], _Init]:
    """Makes the decorated ``RankGuard.__init__`` build every guard and drive them with ``base``.

    The decorated function only declares the signature editors and type checkers
    show (``tools/generate_api.py`` writes it from the registry); it is replaced
    by one taking ``**per_guard_config``, so that an unknown guard name raises
    the ``ValueError`` that names the closest valid one. ``inspect.signature``
    (config tools such as LightningCLI's jsonargparse read it) shows
    :func:`_bundle_signature`.

    Args:
        base: The adapter's base class; its ``__init__(guards, exchange_timeout_s)``
            drives the guards.
        defaults: The framework's own settings per guard name, under the user's.
    """

    def declare(declared: _Init) -> _Init:
        def bundle_init(
            self: Any, exchange_timeout_s: float = 300.0, **per_guard_config: dict[str, Any] | bool
        ) -> None:
            base.__init__(self, bundle_guards(per_guard_config, defaults), exchange_timeout_s)

        _declared_as(bundle_init, declared, _bundle_signature())
        return cast("_Init", bundle_init)

    return declare


def guard_init(
    base: type[Any], guard_name: str, defaults: Defaults | None = None
) -> Callable[[_Init], _Init]:
    """Makes the decorated ``__init__`` of a single-guard class build guard ``guard_name``.

    As :func:`bundle_init`: the decorated function declares the guard's settings
    for tools; the one that runs passes on only the settings given (so the
    framework's ``defaults`` apply to the others, and an unknown setting raises
    the ``ValueError`` naming the closest one), and ``inspect.signature`` shows
    the core guard's own signature.
    """

    def declare(declared: _Init) -> _Init:
        def guard_init(self: Any, **settings: Any) -> None:
            base.__init__(self, single_guard(guard_name, settings, defaults))

        signature = inspect.signature(GUARDS[guard_name].__init__, eval_str=True)
        _declared_as(guard_init, declared, signature)
        return cast("_Init", guard_init)

    return declare
