"""What every adapter shares: building guards, their names, the metric-name check.

Every adapter module exports the same names: ``RankGuard`` (every guard) and
one class per registered guard (``BatchParityGuard``, ...), declared once in
``rankguard.integrations._api``; their ``__init__`` builds the guards here.
:func:`metric_reduction_check` finds the hang watchdog's check of the names a
framework reduces (OLMo-core's flush, Composer's loss).
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.hang.hang_watchdog import HangWatchdog
from rankguard.callbacks.hang.metric_reductions import ReductionCheck
from rankguard.callbacks.registry import GUARDS, build_guard, build_guards, unknown_name_error

__all__ = [
    "GUARD_STATE_FILE",
    "Defaults",
    "Unhook",
    "bundle_guards",
    "class_name",
    "load_guard_state",
    "metric_reduction_check",
    "on_raise",
    "require",
    "resolved_checkpoint",
    "save_guard_state",
    "single_guard",
    "wrap_method",
]

logger = logging.getLogger(__name__)

Defaults = Mapping[str, Mapping[str, Any]]
#: Removes a wrapper it was returned for (safe to call twice).
Unhook = Callable[[], None]


def require(integration: str, modules: tuple[str, ...], needs: str, extra: str) -> None:
    """Raises the ``ImportError`` that names the pip extra where a framework is missing.

    The first line of each integration package (its modules import the framework
    plainly after it), e.g. ``require("composer", ("composer",), "Composer", "composer")``.
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ImportError(
                f"rankguard.integrations.{integration} needs {needs}: "
                f"pip install 'rankguard[{extra}]'"
            ) from exc


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


def metric_reduction_check(
    guards: Iterable[Guard],
    name: str,
    *,
    where: str,
    fix: str,
    notes: Mapping[str, str] | None = None,
) -> ReductionCheck | None:
    """The hang watchdog's check of a reduction's names (at FIT_START, once the channel is open).

    ``None`` without a watchdog among ``guards``, on one rank, or with
    ``check_metric_reductions=False``; see :meth:`HangWatchdog.metric_reduction_check`.
    """
    watchdog = next((g for g in guards if isinstance(g, HangWatchdog)), None)
    if watchdog is None or not watchdog.channel.is_distributed:
        return None
    return watchdog.metric_reduction_check(name, where=where, fix=fix, notes=notes)


def wrap_method(
    obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Unhook:
    """Replaces ``obj.name`` on the instance with ``make(original)``; returns the undo.

    The undo removes the wrapper only while it is still the instance's own
    attribute, so undoing twice, or after someone else re-wrapped it, is safe.
    """
    original = getattr(obj, name)
    wrapper = functools.wraps(original)(make(original))
    setattr(obj, name, wrapper)

    def unhook() -> None:
        if vars(obj).get(name) is wrapper:
            delattr(obj, name)

    return unhook


def on_raise(obj: Any, name: str, on_error: Callable[[BaseException], None]) -> Unhook:
    """Wraps ``obj.name`` so ``on_error(exc)`` runs where an exception leaves it; returns the undo.

    The exception then propagates unchanged, unless a request to end the process came
    while ``on_error`` told the other ranks (``HangWatchdog.on_error`` raises that one). A
    framework without an exception event (Composer's ``fit``) is seen failing there, before
    its caller's ``finally``.
    """

    def make(method: Callable[..., Any]) -> Callable[..., Any]:
        def raising(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except BaseException as exc:
                on_error(exc)
                raise

        return raising

    return wrap_method(obj, name, make)


def resolved_checkpoint(path: str | None) -> str | None:
    """The checkpoint ``path`` names on this rank: a local one with its links resolved."""
    if not path or "://" in path:
        return path or None
    return os.path.realpath(path)


#: The guards' checkpoint state, in a checkpoint folder, where a framework keeps no
#: callback state of its own (the Hugging Face Trainer's).
GUARD_STATE_FILE = "rankguard_state.json"


class GuardState(Protocol):
    """What holds the guards' checkpoint state (an adapter's driver)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def save_guard_state(guards: GuardState, folder: str) -> None:
    """Writes ``guards.state_dict()`` into checkpoint ``folder`` (nothing if it is empty).

    Call it on the process that writes the checkpoint, after the save's
    CHECKPOINT_SAVE_START (whose exchange the state records).
    """
    state = guards.state_dict()
    if not state or not os.path.isdir(folder):
        return
    path = os.path.join(folder, GUARD_STATE_FILE)
    with open(f"{path}.tmp", "w") as file:
        json.dump(state, file)
    os.replace(f"{path}.tmp", path)


def load_guard_state(guards: GuardState, folder: str) -> None:
    """Gives the guards what :func:`save_guard_state` wrote into ``folder``, if it is there."""
    path = os.path.join(folder, GUARD_STATE_FILE)
    try:
        with open(path) as file:
            state = json.load(file)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as exc:  # a torn or foreign file: checked without it
        logger.info("rankguard: cannot read %s (%s)", path, exc)
        return
    guards.load_state_dict(state)
