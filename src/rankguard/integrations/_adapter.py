"""What every adapter is made of, written once: :class:`Adapter`.

An adapter translates: its framework's events into core events (its event map)
and its framework's objects into facts. Everything else every adapter needs is
here: the :class:`~rankguard.integrations._driver.EventDriver`, its one door to
the guards (it fires core events in order and holds the step log), the framework
methods it wrapped (each with its undo), the guards' metrics until the framework
takes them, the sequence that lets the guards explain an error and then stops
them, and the guards' checkpoint state. See docs/integrations.md#adding-an-integration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rankguard.callbacks.core.guard import Guard, GuardRunner
from rankguard.callbacks.hang.stop import STOP_EXIT_CODE, StopAgreement, exit_at_interpreter_exit
from rankguard.integrations._common import Unhook, on_raise, wrap_method
from rankguard.integrations._driver import EventDriver

__all__ = ["Adapter", "exit_after_stop", "stop_agreement"]

logger = logging.getLogger("rankguard.integrations")


def stop_agreement(guards: Iterable[Guard]) -> StopAgreement | None:
    """The hang watchdog's preemption agreement, where the guards hold a watchdog."""
    found = (getattr(g, "stop_agreement", None) for g in guards)
    return next((s for s in found if isinstance(s, StopAgreement)), None)


def exit_after_stop(stop: StopAgreement | None, after: str) -> bool:
    """After an agreed stop: this process exits with 75 when Python exits (``after`` first).

    Returns whether it will (``stop`` stopped this fit). The one exit of every adapter
    that ends its loop on the agreement (docs/hang.md#preemption-every-rank-stops-at-one-step).
    """
    if stop is None or stop.stopped is None:
        return False
    exit_at_interpreter_exit(STOP_EXIT_CODE, stop.channel, stop.grace_s)
    logger.info(
        "rankguard: %s; this process exits with code %d when Python exits (after %s)",
        stop.stopped.reason,
        STOP_EXIT_CODE,
        after,
    )
    return True


class Adapter:
    """The base of every adapter: runner, driver, wrapped methods, metrics, errors, state.

    Args:
        guards: The guards, in run order (``RankGuard`` builds them).
        exchange_timeout_s: The side channel's default timeout.

    Attributes:
        driver: The adapter's one door to the guards: fires core events on their runner
            in order, holds the step log; the guards' metrics go to
            :meth:`buffer_metrics` until the adapter hands them on (:meth:`take_metrics`).
    """

    def __init__(self, guards: list[Guard], exchange_timeout_s: float = 300.0) -> None:
        runner = GuardRunner(guards, exchange_timeout_s=exchange_timeout_s)
        self.driver = EventDriver(runner, self.buffer_metrics)
        self._unhooks: list[Unhook] = []
        self._metrics: dict[str, float] = {}

    # -- wrapped framework methods ------------------------------------------------------

    def wrap(self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Any]) -> None:
        """Wraps ``obj.name`` on the instance with ``make(original)`` until :meth:`unwrap`."""
        self._unhooks.append(wrap_method(obj, name, make))

    def add_undo(self, undo: Unhook) -> None:
        """Runs ``undo`` at :meth:`unwrap`, as a wrapper's (for wrappers made elsewhere)."""
        self._unhooks.append(undo)

    def watch_raise(
        self, obj: Any, name: str, on_error: Callable[[BaseException], None] | None = None
    ) -> None:
        """Lets the guards see an error where it leaves ``obj.name``.

        ``on_error`` gets it (default: :meth:`fail`); the error then propagates unchanged.
        """
        self._unhooks.append(on_raise(obj, name, on_error or self.fail))

    @property
    def runner(self) -> GuardRunner:
        """The guards' runner, as the driver holds it (tests and tools; adapters use ``driver``)."""
        return self.driver.runner

    @property
    def reads_phases(self) -> bool:
        """Whether a guard reads a batch's parts (backward passes, optimizer steps).

        The hang watchdog's history does; an adapter that must hook them itself (a loop's
        backward) does so only then.
        """
        return any(getattr(g, "reads_phases", False) for g in self.driver.guards)

    @property
    def wrapped(self) -> bool:
        """Whether any framework method is wrapped now."""
        return bool(self._unhooks)

    def unwrap(self) -> None:
        """Removes every wrapper (safe to call twice)."""
        while self._unhooks:
            self._unhooks.pop()()

    # -- metrics ------------------------------------------------------------------------

    def buffer_metrics(self, metrics: Mapping[str, float]) -> None:
        """The guards' metric sink: kept until the framework can take them."""
        self._metrics.update(metrics)

    def take_metrics(self) -> dict[str, float]:
        """The metrics kept since the last call (empty if none)."""
        metrics, self._metrics = self._metrics, {}
        return metrics

    # -- errors and the end -------------------------------------------------------------

    def fail(
        self,
        exc: BaseException,
        step: int | None = None,
        epoch: int | None = None,
        *,
        fitting: bool | None = None,
    ) -> None:
        """An error left the fit: the guards explain it (``on_error``), then every guard stops.

        Args:
            exc: The error.
            step: The framework's step (default: the driver's).
            epoch: The framework's epoch (default: the driver's).
            fitting: Whether the error is the fit's, for a framework that raises it outside
                FIT_START..FIT_END too (Lightning's sanity check); default: while a fit runs.
                Outside a fit the guards only stop.

        Raises:
            SystemExit: Only a request to end the process (a launcher's SIGTERM, raised by
                the framework's handler) that came while a guard told the other ranks; the
                guards have stopped by then. Nothing else.
        """
        explain = self.driver.fitting if fitting is None else fitting
        self.driver.abandon(exc if explain else None, step, epoch)

    # -- a preemption agreed across ranks -----------------------------------------------

    def install_stop(self) -> StopAgreement | None:
        """Catches the watchdog's ``stop_signals`` for this fit; returns its agreement, or ``None``.

        Called at fit start by an adapter that ends its loop on the agreement, once the
        framework's own handlers are in place (they are kept and restored at close).
        """
        stop = stop_agreement(self.driver.guards)
        if stop is not None:
            stop.install()
        return stop

    def stop(self) -> None:
        """Stops every guard and removes every wrapper; safe to call twice and after an error."""
        self.driver.fitting = False
        self.unwrap()
        self.driver.close()

    # -- checkpoint state ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The guards' state (plain values) to save with a checkpoint.

        The hang watchdog's calibration (a resumed job starts with calibrated
        deadlines) and each rank's data-position and random-state digests at the
        last save (the resume check). A loop saves it itself:
        ``torch.save({"model": ..., "rankguard": guard.state_dict()}, path)``.
        """
        return self.driver.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores what :meth:`state_dict` saved, before the resumed fit (an empty dict: none)."""
        self.driver.load_state_dict(state_dict)
