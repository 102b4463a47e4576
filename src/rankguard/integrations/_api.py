"""The public classes' settings, declared once for every integration.

Each integration module joins a class here to its adapter, in that order:
``class HangWatchdog(HangWatchdogSettings, _LightningAdapter)``. A single-guard
class's settings are its core guard's own ``__init__`` (:func:`guard_settings`
passes them on to editors and type checkers); ``RankGuard``'s are declared
here. Docs: docs/design.md#how-it-works.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from rankguard.callbacks.batches.batch_parity_guard import BatchParityGuard
from rankguard.callbacks.batches.drop_last_guard import DropLastGuard
from rankguard.callbacks.checkpoint.checkpoint_planner import CheckpointPlanner
from rankguard.callbacks.checkpoint.shared_dir_barrier import SharedDirBarrier
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.data.data_consistency_guard import DataConsistencyGuard
from rankguard.callbacks.data.data_stall_monitor import DataStallMonitor
from rankguard.callbacks.hang.hang_watchdog import HangWatchdog
from rankguard.callbacks.replica.replica_guard import ReplicaGuard
from rankguard.callbacks.resume.resume_guard import ResumeGuard
from rankguard.callbacks.straggler.straggler_monitor import StragglerMonitor
from rankguard.integrations._common import Defaults, bundle_guards, single_guard

#: The public classes every integration module exports, under the same names.
CLASS_NAMES = (
    "BatchParityGuard",
    "CheckpointPlanner",
    "DataConsistencyGuard",
    "DataStallMonitor",
    "DropLastGuard",
    "HangWatchdog",
    "RankGuard",
    "ReplicaGuard",
    "ResumeGuard",
    "SharedDirBarrier",
    "StragglerMonitor",
)

_P = ParamSpec("_P")
_F = TypeVar("_F", bound=Callable[..., None])


def _adapter_init(self: Any, guards: list[Guard], exchange_timeout_s: float = 300.0) -> None:
    """Hands the guards to the adapter: the base after :class:`_Settings` in the class's order."""
    init: Callable[..., None] = super(_Settings, self).__init__
    init(guards, exchange_timeout_s)


def _framework_defaults(obj: Any) -> Defaults:
    """The adapter's own settings per guard name (``framework_defaults``), under the user's."""
    return getattr(obj, "framework_defaults", None) or {}


def bundle_settings(declared: _F) -> _F:
    """Makes the decorated ``RankGuard.__init__`` build every guard (its body is not run).

    The decorated function declares the settings editors, type checkers and
    ``inspect.signature`` show; the one that runs takes ``**per_guard_config``,
    so that an unknown guard name raises the ``ValueError`` that names the
    closest valid one.
    """

    def __init__(
        self: Any, exchange_timeout_s: float = 300.0, **per_guard_config: dict[str, Any] | bool
    ) -> None:
        guards = bundle_guards(per_guard_config, _framework_defaults(self))
        _adapter_init(self, guards, exchange_timeout_s)

    return _declared(__init__, declared, declared, None)  # type: ignore[no-any-return]


def guard_settings(
    guard: Callable[_P, Guard],
) -> Callable[[Callable[..., None]], Callable[Concatenate[Any, _P], None]]:
    """Makes the decorated ``__init__`` take and build the core ``guard``'s own settings.

    Editors and type checkers show ``guard``'s settings (its ``__init__``, the
    one definition); the decorated function only gives its name. The one
    that runs passes on only the settings given, so the adapter's
    ``framework_defaults`` apply to the others (and an unknown setting raises
    the ``ValueError`` naming the closest one).
    """
    name: str = guard.name  # type: ignore[attr-defined]

    def __init__(self: Any, **settings: Any) -> None:
        _adapter_init(self, single_guard(name, settings, _framework_defaults(self)))

    def declare(declared: Callable[..., None]) -> Callable[Concatenate[Any, _P], None]:
        declared.__doc__ = f"Builds :class:`rankguard.callbacks.{guard.__name__}` (its settings)."
        return _declared(__init__, guard.__init__, declared, name)  # type: ignore[misc]

    return declare


def _declared(
    init: Callable[..., None],
    settings: Callable[..., Any],
    declared: Callable[..., None],
    guard: str | None,
) -> Any:
    """``init`` with ``settings``' signature (config tools read it), ``declared``'s name and doc.

    ``init.guard`` is the guard name it builds (``None``: every guard), for :func:`_own_init`.
    """
    signature = inspect.signature(settings, eval_str=True)
    vars(init).update(__signature__=signature, guard=guard)
    init.__doc__ = declared.__doc__
    init.__qualname__ = declared.__qualname__
    return init


class _Settings:
    """Base of the settings classes below; an integration's class gets its own ``__init__``.

    That ``__init__`` is the settings class's, with the adapter's
    ``framework_defaults`` as its signature's defaults, so that config tools
    (LightningCLI's jsonargparse) pass on the values the class uses.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if any(not issubclass(base, _Settings) for base in cls.__bases__):  # joins an adapter
            cls.__init__ = _own_init(cls)  # type: ignore[method-assign]


def _own_init(cls: type) -> Callable[..., None]:
    """A copy of ``cls``'s settings ``__init__`` that shows ``cls``'s own defaults."""
    shared: Callable[..., None] = inspect.getattr_static(cls, "__init__")

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        shared(self, *args, **kwargs)

    signature = inspect.signature(shared)
    defaults = _framework_defaults(cls).get(vars(shared)["guard"], {})
    params = [
        p.replace(default=defaults.get(p.name, p.default)) for p in signature.parameters.values()
    ]
    vars(__init__).update(vars(shared), __signature__=signature.replace(parameters=params))
    __init__.__doc__ = shared.__doc__
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__module__ = cls.__module__
    return __init__


class RankGuardSettings(_Settings):
    """Every rankguard guard with sound defaults (``RankGuard`` of each integration)."""

    @bundle_settings
    def __init__(
        self,
        exchange_timeout_s: float = 300.0,
        *,
        hang_watchdog: dict[str, Any] | bool = True,
        data_consistency_guard: dict[str, Any] | bool = True,
        drop_last_guard: dict[str, Any] | bool = True,
        batch_parity_guard: dict[str, Any] | bool = True,
        shared_dir_barrier: dict[str, Any] | bool = True,
        resume_guard: dict[str, Any] | bool = True,
        replica_guard: dict[str, Any] | bool = True,
        checkpoint_planner: dict[str, Any] | bool = True,
        data_stall_monitor: dict[str, Any] | bool = True,
        straggler_monitor: dict[str, Any] | bool = True,
    ) -> None:
        """Builds every guard: one keyword per guard of the registry, in its order.

        Args:
            exchange_timeout_s: How long a cross-rank check waits for every rank
                before naming the ones that did not arrive (seconds; grows by 5 ms
                per rank with the world size, see ``docs/scale.md``). The hang
                watchdog's own exchanges use its settings.
            hang_watchdog: Per guard, by snake-case name, a dict of its settings,
                ``True`` for the integration's defaults, or ``False`` to leave it
                out, e.g. ``RankGuard(batch_parity_guard={"on_violation": "warn"},
                drop_last_guard=False)``.
            data_consistency_guard: As ``hang_watchdog``.
            drop_last_guard: As ``hang_watchdog``.
            batch_parity_guard: As ``hang_watchdog``.
            shared_dir_barrier: As ``hang_watchdog``.
            resume_guard: As ``hang_watchdog``.
            replica_guard: As ``hang_watchdog``.
            checkpoint_planner: As ``hang_watchdog``.
            data_stall_monitor: As ``hang_watchdog``.
            straggler_monitor: As ``hang_watchdog``.
        """


class HangWatchdogSettings(_Settings):
    """The hang watchdog alone."""

    @guard_settings(HangWatchdog)
    def __init__(self, **settings: Any) -> None: ...


class DataConsistencyGuardSettings(_Settings):
    """The data consistency guard alone."""

    @guard_settings(DataConsistencyGuard)
    def __init__(self, **settings: Any) -> None: ...


class DropLastGuardSettings(_Settings):
    """The drop-last guard alone."""

    @guard_settings(DropLastGuard)
    def __init__(self, **settings: Any) -> None: ...


class BatchParityGuardSettings(_Settings):
    """The batch parity guard alone."""

    @guard_settings(BatchParityGuard)
    def __init__(self, **settings: Any) -> None: ...


class SharedDirBarrierSettings(_Settings):
    """The shared-directory barrier alone."""

    @guard_settings(SharedDirBarrier)
    def __init__(self, **settings: Any) -> None: ...


class ResumeGuardSettings(_Settings):
    """The resume check alone."""

    @guard_settings(ResumeGuard)
    def __init__(self, **settings: Any) -> None: ...


class ReplicaGuardSettings(_Settings):
    """The replica check alone."""

    @guard_settings(ReplicaGuard)
    def __init__(self, **settings: Any) -> None: ...


class CheckpointPlannerSettings(_Settings):
    """The checkpoint planner alone."""

    @guard_settings(CheckpointPlanner)
    def __init__(self, **settings: Any) -> None: ...


class DataStallMonitorSettings(_Settings):
    """The data stall monitor alone."""

    @guard_settings(DataStallMonitor)
    def __init__(self, **settings: Any) -> None: ...


class StragglerMonitorSettings(_Settings):
    """The straggler monitor alone."""

    @guard_settings(StragglerMonitor)
    def __init__(self, **settings: Any) -> None: ...
