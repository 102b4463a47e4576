"""The loop's wrapped loaders and save, the fit they share, and the checks of its arguments.

The wrappers are what ``run.train``, ``run.eval`` and ``run.checkpoint`` return. Each
turns the loop's own iteration into the driver's events; see
:mod:`rankguard.integrations.torch` for the run they belong to. The run and its
wrappers share one :class:`Fit` (the run owns it), and a loop guard keeps its
:class:`Fits` (the fit running, the resume told for the next).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any

from rankguard.callbacks.core.events import LoaderFacts, LoaderPass, ResumeFacts
from rankguard.callbacks.hang.stop import StopAgreement
from rankguard.integrations._adapter import Adapter
from rankguard.integrations._driver import EventDriver

logger = logging.getLogger("rankguard.integrations.torch")

__all__ = [
    "ORDER",
    "EvalLoader",
    "EvalPass",
    "Fit",
    "Fits",
    "Load",
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
