"""What every adapter shares: building guards from callback arguments, and its public classes.

Every adapter module exports the same names: ``RankGuard`` (every guard) and
one class per registered guard (``BatchParityGuard``, ...). They differ only
in the adapter base class they extend, so :func:`define_callbacks` defines
them all from the registry, once, for each adapter: real classes with
docstrings and explicit signatures (config tools such as LightningCLI's
jsonargparse read them), which never drift from what the core guards accept.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from rankguard.callbacks.guard import Guard
from rankguard.callbacks.registry import GUARDS, build_guard, build_guards, unknown_name_error

__all__ = ["bundle_guards", "class_name", "define_callbacks", "single_guard"]

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


def _subclass(
    base: type, name: str, module: str, init: Callable[..., None], doc: str, signature: Any
) -> type:
    init.__signature__ = signature  # type: ignore[attr-defined]
    init.__qualname__ = f"{name}.__init__"
    init.__doc__ = f"Builds the guards of :class:`{name}`."
    return type(name, (base,), {"__init__": init, "__doc__": doc, "__module__": module})


def _single_init(base: type, guard_name: str, defaults: Defaults | None) -> Callable[..., None]:
    def guard_init(self: Any, **settings: Any) -> None:
        base.__init__(self, single_guard(guard_name, settings, defaults))

    return guard_init


def define_callbacks(
    namespace: MutableMapping[str, Any],
    base: type,
    kind: str,
    defaults: Defaults | None = None,
) -> list[str]:
    """Defines an adapter's ``RankGuard`` and one class per registered guard in its module.

    Each class extends ``base``, whose ``__init__(guards, exchange_timeout_s)``
    drives the guards; ``RankGuard(exchange_timeout_s, **per_guard_config)``
    builds every guard, ``BatchParityGuard(**settings)`` (and so on) one.

    Args:
        namespace: The adapter module's globals; the classes are added to it.
        base: The adapter's base class.
        kind: What the classes are in the framework, for their docstrings,
            e.g. ``"a Composer callback"``.
        defaults: The framework's own settings per guard name, under the user's.

    Returns:
        The names defined, for the module's ``__all__``.
    """
    module = namespace["__name__"]

    def bundle_init(
        self: Any, exchange_timeout_s: float = 300.0, **per_guard_config: dict[str, Any] | bool
    ) -> None:
        base.__init__(self, bundle_guards(per_guard_config, defaults), exchange_timeout_s)

    classes = {
        "RankGuard": _subclass(
            base,
            "RankGuard",
            module,
            bundle_init,
            BUNDLE_DOC.format(kind=kind),
            _bundle_signature(),
        )
    }
    for guard_name, guard in GUARDS.items():
        name = class_name(guard_name)
        what = f"{kind[0].upper()}{kind[1:]}"
        doc = f"{what} for :class:`rankguard.callbacks.{name}` (same arguments)."
        signature = inspect.signature(guard.__init__, eval_str=True)
        init = _single_init(base, guard_name, defaults)
        classes[name] = _subclass(base, name, module, init, doc, signature)
    namespace.update(classes)
    return sorted(classes)
