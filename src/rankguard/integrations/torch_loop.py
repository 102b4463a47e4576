"""A loop's run (:class:`Run`, what ``guard.fit(...)`` makes), its passes, and their checks.

The run's ``train``, ``eval`` and ``checkpoint`` return the wrapped loaders and the save:
each turns the loop's own iteration into the driver's events. The run and its passes
share one :class:`Fit` (the run owns it), and a loop guard
(:mod:`rankguard.integrations.torch`) keeps its :class:`Fits` (the fit running, the
resume told for the next).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any

from rankguard.callbacks.core.events import LoaderFacts, LoaderPass, ResumeFacts
from rankguard.callbacks.hang.stop import STOP_EXIT_CODE, StopAgreement
from rankguard.integrations._adapter import Adapter, exit_after_stop
from rankguard.integrations._driver import EventDriver
from rankguard.integrations.torch_phases import announce_phases

logger = logging.getLogger("rankguard.integrations.torch")

__all__ = [
    "ORDER",
    "SHARDED_SETTING",
    "EvalLoader",
    "EvalPass",
    "Fit",
    "Fits",
    "Load",
    "MetricsFn",
    "Run",
    "Save",
    "TrainLoader",
    "TrainPass",
    "check_dirs",
    "check_eval",
    "check_fit",
    "check_iterable",
    "eval_facts",
]

ORDER = (
    "Expected order: `with guard.fit(...) as run:` once, then inside it `for batch in "
    "run.train(loader)`, `for batch in run.eval(loader)` and `with run.checkpoint(dir):` "
    "(one at a time, on every rank)."
)


#: What a hand-written loop changes to save sharded checkpoints, named in rankguard's messages.
SHARDED_SETTING = (
    "torch.distributed.checkpoint.save({'model': model_sd, 'optim': optim_sd}, "
    "checkpoint_id=folder) with the sharded state dicts of "
    "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer), and "
    "guard.fit(..., state_dict_type='sharded')"
)

MetricsFn = Callable[[dict[str, float]], Any]


# -- the arguments of guard.fit and run.checkpoint --------------------------------------


def check_iterable(name: str, loader: Any) -> Any:
    """``loader``, if it is an iterable of batches (``ValueError`` names ``name`` if not)."""
    if not isinstance(loader, Iterable):
        raise ValueError(f"`{name}` must be an iterable of batches (a DataLoader); got {loader!r}.")
    return loader


def check_dirs(save_dirs: Any) -> list[str]:
    """``save_dirs`` (a path or paths) as a list of paths (``ValueError`` if not)."""
    if save_dirs is None:
        return []
    if isinstance(save_dirs, str | os.PathLike):
        save_dirs = [save_dirs]
    if isinstance(save_dirs, Iterable):
        save_dirs = list(save_dirs)
    if not isinstance(save_dirs, list) or not all(
        isinstance(d, str | os.PathLike) and str(d) for d in save_dirs
    ):
        raise ValueError(
            f"`save_dirs` must be a directory path or a list of them; got {save_dirs!r}."
        )
    return [os.fspath(d) for d in save_dirs]


def eval_facts(eval_loaders: Any) -> dict[str, LoaderFacts]:
    """The eval loaders by name (one loader is ``"eval"``), checked."""
    if eval_loaders is None:
        return {}
    if not isinstance(eval_loaders, Mapping):
        eval_loaders = {"eval": eval_loaders}
    facts = {}
    for name, loader in eval_loaders.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"`eval_loaders` names must be non-empty strings; got {name!r}.")
        facts[name] = LoaderFacts(name, check_iterable(f"eval_loaders[{name!r}]", loader), False)
    return facts


STATE_DICT_TYPES = ("full", "sharded")


def check_fit(model: Any, optimizer: Any, state_dict_type: Any, log_metrics: Any) -> None:
    """Checks ``guard.fit``'s other arguments (``ValueError`` naming the wrong one)."""
    if state_dict_type is not None and state_dict_type not in STATE_DICT_TYPES:
        raise ValueError(
            f"`state_dict_type` must be one of 'full', 'sharded' or None; got {state_dict_type!r}."
        )
    if optimizer is not None and not hasattr(optimizer, "param_groups"):
        raise ValueError(f"`optimizer` must be a torch optimizer or None; got {optimizer!r}.")
    if model is not None and not hasattr(model, "parameters"):
        raise ValueError(f"`model` must be a torch.nn.Module or None; got {model!r}.")
    if log_metrics is not None and not callable(log_metrics):
        raise ValueError(f"`log_metrics` must be callable or None; got {log_metrics!r}.")


def check_eval(loader: Any, name: Any, max_batches: Any) -> None:
    """Checks ``run.eval``'s arguments (``ValueError`` naming the wrong one)."""
    check_iterable("loader", loader)
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"`name` must be a non-empty string or None; got {name!r}.")
    if max_batches is not None and (
        isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1
    ):
        raise ValueError(f"`max_batches` must be an integer >= 1 or None; got {max_batches!r}.")


# -- the state a fit's run and its passes share ------------------------------------------


class Fit:
    """One fit's state, shared by its ``Run`` and the wrapped loaders, passes and save.

    The run owns it (``guard.fit(...)`` makes both); the wrappers read it and move it on.

    Attributes:
        driver: The guard's event driver (one for every fit).
        model: The model the fit trains (for a save's checkpoint memory plan).
        state: ``"new"`` before the ``with`` block, ``"active"`` inside it, ``"ended"`` after.
        train_pass: The last train pass, until its EPOCH_END (:meth:`close_epoch`).
        eval_pass: The eval in progress, until its EVAL_END.
        save: The save in progress (inside ``with run.checkpoint(...)``).
        left_early: The eval loaders the loop left early (said once per loader).
        stop: The preemption's agreement, installed at fit start.
    """

    def __init__(self, driver: EventDriver, model: Any) -> None:
        self.driver = driver
        self.model = model
        self.state = "new"  # new -> active -> ended
        self.train_pass: TrainPass | None = None
        self.eval_pass: EvalPass | None = None
        self.save: Save | None = None
        self.left_early: set[str] = set()
        self.stop: StopAgreement | None = None

    def require(self, call: str) -> None:
        """Raises ``RuntimeError`` naming ``call`` unless the fit is active and not saving."""
        if self.state != "active":
            when = (
                "before its `with guard.fit(...)` block"
                if self.state == "new"
                else "after its `with guard.fit(...)` block ended"
            )
            raise RuntimeError(f"`{call}` used {when}. {ORDER}")
        if self.save is not None:
            raise RuntimeError(
                f"`{call}` used inside `with run.checkpoint(...)`: a save ends before the next "
                f"train batch or eval starts. {ORDER}"
            )

    def close_epoch(self) -> None:
        """EPOCH_END of the last train pass, with what its iterator did (next epoch, fit end).

        Not at ``StopIteration``: a rank whose loader ran out first would wait in
        the check while the others still run batches (and a loop that stops every
        rank when one runs out, or DDP's ``join``, still needs it in collectives).
        """
        it, self.train_pass = self.train_pass, None
        if it is not None:
            self.driver.epoch_end(it.facts, LoaderPass(it.yielded, it.exhausted))

    def close_eval(self) -> None:
        """Ends an eval the loop left early, with the batches that ran as its plan."""
        if self.eval_pass is not None:
            self.eval_pass.finish(early=True)


class Fits:
    """A loop guard's fits: the one running (fits do not nest), the resume the next compares.

    Attributes:
        running: The fit inside its ``with`` block, else ``None``.
        resume: What ``guard.resumed(...)`` told, until the next fit starts.
    """

    def __init__(self) -> None:
        self.running: Fit | None = None
        self.resume: ResumeFacts | None = None


# -- the wrapped loaders and save -------------------------------------------------------


class TrainLoader:
    """The train loader wrapped by :meth:`Run.train`; one iteration is one epoch."""

    def __init__(self, fit: Fit, loader: Iterable[Any]) -> None:
        self._fit = fit
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        fit = self._fit
        fit.require("run.train(...)")
        fit.close_eval()
        fit.close_epoch()
        driver = fit.driver
        facts = LoaderFacts("train", self.loader, is_train=True)
        driver.epoch_start(facts)
        fit.train_pass = TrainPass(fit, facts, driver.epoch)
        return fit.train_pass


class TrainPass:
    """One epoch's pass over the train loader: what it returned, and whether it ran out."""

    def __init__(self, fit: Fit, facts: LoaderFacts, epoch: int) -> None:
        self._fit = fit
        self.facts = facts
        self._iterator = iter(facts.loader)
        self._epoch = epoch
        self.yielded = 0
        self.exhausted = False

    def __iter__(self) -> TrainPass:
        return self

    def __next__(self) -> Any:
        fit = self._fit
        driver = fit.driver
        if fit.state != "active" or fit.save is not None:  # once a batch: checks inlined
            fit.require("run.train(...)")
        if driver.epoch != self._epoch:
            raise RuntimeError(
                f"A `run.train(...)` iterator of epoch {self._epoch} used after epoch "
                f"{driver.epoch} started: iterate `run.train(loader)` once per epoch. {ORDER}"
            )
        if fit.eval_pass is not None:
            fit.close_eval()
        driver.fetch_start()
        stop = fit.stop  # a preemption: every rank's pass ends after the agreed step
        if stop is not None and stop.requested and stop.at_boundary(driver.step):
            raise StopIteration
        try:
            batch = next(self._iterator)
        except StopIteration:  # the epoch ends at the next epoch start or the fit's end
            self.exhausted = True
            raise
        self.yielded += 1
        driver.fetch_end_batch_start(batch)
        return batch


class EvalLoader:
    """An eval loader wrapped by :meth:`Run.eval`; one iteration is one evaluation."""

    def __init__(self, fit: Fit, facts: LoaderFacts) -> None:
        self._fit = fit
        self.facts = facts

    def __len__(self) -> int:
        length = len(self.facts.loader)
        cap = self.facts.num_batches
        return length if cap is None else min(length, cap)

    def __iter__(self) -> Iterator[Any]:
        fit = self._fit
        fit.require("run.eval(...)")
        fit.close_eval()
        fit.driver.eval_start([self.facts])
        it = EvalPass(fit, self.facts)
        fit.eval_pass = it
        return it


class EvalPass:
    """One evaluation's pass over an eval loader: the batches it started, whether it ran out."""

    def __init__(self, fit: Fit, facts: LoaderFacts) -> None:
        self._fit = fit
        self.facts = facts
        self._iterator = iter(facts.loader)
        self.started = 0
        self._ended = False
        self._exhausted = False
        self._ran_out = False  # the loader's own iterator raised StopIteration

    def __iter__(self) -> EvalPass:
        return self

    def __next__(self) -> Any:
        fit = self._fit
        if self._ended:
            if self._exhausted:
                raise StopIteration
            raise RuntimeError(
                f"Eval of {self.facts.name!r} was already ended when the loop moved on; "
                f"iterate `run.eval(loader)` again for a new evaluation. {ORDER}"
            )
        fit.require("run.eval(...)")
        driver = fit.driver
        cap = self.facts.num_batches
        if cap is not None and self.started >= cap:
            self.finish(early=False)
            raise StopIteration
        if self.started:
            driver.eval_batch_end()
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._ran_out = True
            self.finish(early=False)
            raise
        driver.eval_batch_start()
        self.started += 1
        return batch

    def finish(self, early: bool) -> None:
        """EVAL_END; ``early``: the loop left it, so the batches that ran are its plan.

        The pass is exhausted only where the loader's iterator ran out; one that
        ``max_batches`` or the loop stopped is not (it may have had more).
        """
        self._ended = True
        self._exhausted = not early
        fit = self._fit
        fit.eval_pass = None
        if early:
            facts = self.facts
            if facts.name not in fit.left_early:  # said once per loader
                fit.left_early.add(facts.name)
                logger.info(
                    "rankguard: the loop left eval %r after %d batches; the batches that ran are "
                    "compared across ranks (`run.eval(loader, max_batches=N)` also checks the "
                    "plan before the first batch)",
                    facts.name,
                    self.started,
                )
        fit.driver.eval_end(
            LoaderPass(self.started, self._ran_out), planned=self.started if early else None
        )


class Save:
    """The context manager of :meth:`Run.checkpoint`."""

    def __init__(self, fit: Fit, directories: list[str]) -> None:
        self._fit = fit
        self.directories = directories
        self._entered = False

    def __enter__(self) -> Save:
        fit = self._fit
        if self._entered or fit.save is not None:
            raise RuntimeError(
                "`run.checkpoint(...)` entered while a save is in progress (saves do not "
                f"nest, and each `run.checkpoint(...)` is entered once). {ORDER}"
            )
        fit.require("run.checkpoint(...)")
        self._entered = True
        fit.close_eval()
        fit.driver.save_start(self.directories, model=fit.model)
        fit.save = self
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        fit = self._fit
        fit.save = None
        fit.driver.save_end(saved=exc is None and fit.state == "active")


class Load:
    """The context manager ``guard.load(path)`` returns."""

    def __init__(self, guard: Adapter, fits: Fits, path: str) -> None:
        self._guard = guard
        self._fits = fits
        self.path = path
        self._outside_fit = False

    def __enter__(self) -> Load:
        fit = self._fits.running
        if fit is not None:
            fit.require("guard.load(...)")
            fit.driver.load_start(self.path)
            return self
        self._outside_fit = True
        try:
            self._guard.driver.load_start(self.path)
        except BaseException:
            self._guard.driver.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._outside_fit:  # the fit that follows starts the guards afresh
            self._outside_fit = False
            self._guard.driver.close()


# -- the run: one fit, its passes made from it -----------------------------------------


class Run:
    """One fit of a hand-written loop; made by ``guard.fit(...)``, used inside ``with``.

    A preemption signal (``HangWatchdog``'s ``stop_signals``, SIGTERM by default) on
    any rank ends every rank's ``run.train(...)`` pass after one agreed step:
    :attr:`stopped` says why; the loop's code after it (a save) runs on every rank;
    the process then exits with :attr:`exit_code` (75) when Python exits, after the
    code that follows the ``with`` block (docs/hang.md#preemption-every-rank-stops-at-one-step)::

        with guard.fit(model, optimizer, loader) as run:
            for epoch in range(epochs):
                for batch in run.train(loader):
                    ...
                if run.stopped:  # preempted: every rank is here, after the same step
                    break
            save(model, optimizer, run.step)

    Attributes:
        metrics: The latest value of each metric the guards logged.
    """

    def __init__(
        self,
        guard: Adapter,
        fits: Fits,
        *,
        model: Any,
        optimizer: Any,
        train: LoaderFacts | None,
        evals: dict[str, LoaderFacts],
        save_dirs: list[str],
        state_dict_type: str | None,
        log_metrics: MetricsFn | None,
    ) -> None:
        self._guard = guard
        self._fits = fits
        self._fit = Fit(guard.driver, model)  # what the wrapped loaders and save share
        self._optimizer = optimizer
        self._train = train
        self._evals = evals
        self._save_dirs = save_dirs
        self._state_dict_type = state_dict_type
        self._user_metrics = log_metrics
        self.metrics: dict[str, float] = {}
        self._unannounce: Callable[[], None] = _nothing  # the backward passes' announcement

    @property
    def stopped(self) -> str | None:
        """Why every rank's training stopped early, or ``None``.

        E.g. ``"preempted by SIGTERM on rank 1 at step 812"``: every rank's
        ``run.train(...)`` ended after train step 812, and any later pass yields no batch.
        """
        stop = self._fit.stop
        stopped = stop.stopped if stop is not None else None
        return stopped.reason if stopped is not None else None

    @property
    def exit_code(self) -> int | None:
        """The code the process exits with when Python exits: 75 after a preemption, else None."""
        return STOP_EXIT_CODE if self.stopped is not None else None

    @property
    def step(self) -> int:
        """Train batches done in this fit (the one in the loop body counts once it started)."""
        driver = self._fit.driver
        return driver.step + int(driver.batch_open)

    @property
    def epoch(self) -> int:
        """Passes over the train loader started in this fit, minus one (-1 before the first)."""
        return self._fit.driver.epoch

    def _log_metrics(self, metrics: Mapping[str, float]) -> None:
        self.metrics.update(metrics)
        if self._user_metrics is not None:
            self._user_metrics(dict(metrics))

    # -- the fit ---------------------------------------------------------------------

    def __enter__(self) -> Run:
        fit = self._fit
        if fit.state != "new":
            raise RuntimeError(
                "This `guard.fit(...)` was already entered; call `guard.fit(...)` again for a "
                f"new fit. {ORDER}"
            )
        if self._fits.running is not None:
            raise RuntimeError(
                "`guard.fit(...)` entered while an earlier fit of this RankGuard is still "
                f"running (fits do not nest): leave the first `with` block first. {ORDER}"
            )
        self._fits.running = fit
        fit.state = "active"
        fit.driver.log_metrics = self._log_metrics
        loaders = ([self._train] if self._train else []) + list(self._evals.values())
        try:
            phases: tuple[str, ...] = ()
            if self._guard.reads_phases:  # the hang watchdog's history reads them
                steps = self._guard.driver.steps
                phases, self._unannounce = announce_phases(steps, self._optimizer)
            fit.driver.fit_start(
                loaders=loaders,
                model=fit.model,
                optimizer=self._optimizer,
                directories=self._save_dirs,
                state_dict_type=self._state_dict_type,
                switch_to_sharded=None,
                sharded_setting=SHARDED_SETTING,
                phases=phases,
            )
            fit.stop = self._guard.install_stop()  # its train pass ends on the agreed step
            resume, self._fits.resume = self._fits.resume, None
            if resume is not None:
                resume.loader = self._train.loader if self._train else None
                fit.driver.resumed(resume)
        except BaseException as exc:
            self._end(exc)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self._end(exc)
            return
        fit = self._fit
        try:
            fit.close_eval()
            fit.close_epoch()
            fit.driver.fit_end()
        except BaseException as error:
            self._end(error)
            raise
        self._end(None)

    def _end(self, exc: BaseException | None) -> None:
        self._unannounce()
        fit = self._fit
        fit.state = "ended"
        self._fits.running = None
        fit.save = None
        fit.train_pass = None
        try:
            if exc is None:
                self._guard.driver.close()
            else:
                self._guard.fail(exc)
        finally:
            self._exit_if_stopped()

    def _exit_if_stopped(self) -> None:
        """After a preemption: exit with 75 once the code after the block ran (at Python exit)."""
        exit_after_stop(self._fit.stop, "your code that follows the `with guard.fit(...)` block")

    # -- train -----------------------------------------------------------------------

    def train(self, loader: Iterable[Any] | None = None) -> TrainLoader:
        """The train loader, wrapped: iterate it once per epoch, as you would the loader.

        Args:
            loader: The train loader (default: the one given to ``guard.fit``).

        Returns:
            An iterable with the loader's ``len()``.
        """
        if loader is None:
            if self._train is None:
                raise ValueError(
                    "`run.train()` needs the train loader: pass it here or to `guard.fit(...)`."
                )
            loader = self._train.loader
        return TrainLoader(self._fit, check_iterable("loader", loader))

    # -- eval ------------------------------------------------------------------------

    def eval(
        self, loader: Iterable[Any], *, name: str | None = None, max_batches: int | None = None
    ) -> EvalLoader:
        """An eval loader, wrapped: iterate it once per evaluation.

        Args:
            loader: The eval loader.
            name: Its name in messages and cross-rank checks (default: its key in
                ``guard.fit(eval_loaders=...)``, else ``"eval"``).
            max_batches: Stop after this many batches (the plan the checks use);
                leaving the loop early with ``break`` works too, and the batches
                that ran are compared across ranks.

        Returns:
            An iterable with the loader's ``len()`` (capped by ``max_batches``).
        """
        check_eval(loader, name, max_batches)
        if name is None:
            name = next((n for n, f in self._evals.items() if f.loader is loader), "eval")
        facts = LoaderFacts(name, loader, is_train=False, num_batches=max_batches)
        return EvalLoader(self._fit, facts)

    # -- checkpoint ------------------------------------------------------------------

    def checkpoint(self, *directories: str | os.PathLike) -> Save:
        """A context manager around one save, entered on every rank.

        On entry every rank sees ``directories`` (created where missing, on the
        right ranks, see ``SharedDirBarrier``) before any rank writes, and the
        hang watchdog applies its checkpoint deadline until the block ends.

        Args:
            *directories: The directories this save writes into (not file
                names); default: ``save_dirs`` of ``guard.fit``.
        """
        dirs = check_dirs(list(directories)) if directories else list(self._save_dirs)
        return Save(self._fit, dirs)


def _nothing() -> None:
    """Undoes nothing (no announcement was made)."""
