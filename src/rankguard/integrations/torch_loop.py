"""The loop's wrapped loaders and save: what ``run.train``, ``run.eval``, ``run.checkpoint`` return.

Each turns the loop's own iteration into the driver's events; see
:mod:`rankguard.integrations.torch` for the run they belong to.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any

from rankguard.callbacks.core.events import LoaderFacts, LoaderPass

__all__ = ["ORDER", "EvalLoader", "EvalPass", "Save", "TrainLoader", "TrainPass"]

ORDER = (
    "Expected order: `with guard.fit(...) as run:` once, then inside it `for batch in "
    "run.train(loader)`, `for batch in run.eval(loader)` and `with run.checkpoint(dir):` "
    "(one at a time, on every rank)."
)


class TrainLoader:
    """The train loader wrapped by :meth:`Run.train`; one iteration is one epoch."""

    def __init__(self, run: Any, loader: Iterable[Any]) -> None:
        self._run = run
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        run = self._run
        run._require("run.train(...)")
        run._close_eval()
        run._close_epoch()
        driver = run._driver
        facts = LoaderFacts("train", self.loader, is_train=True)
        driver.epoch_start(facts)
        run._pass = TrainPass(run, facts, driver.epoch)
        return run._pass


class TrainPass:
    """One epoch's pass over the train loader: what it returned, and whether it ran out."""

    def __init__(self, run: Any, facts: LoaderFacts, epoch: int) -> None:
        self._run = run
        self.facts = facts
        self._iterator = iter(facts.loader)
        self._epoch = epoch
        self.yielded = 0
        self.exhausted = False

    def __iter__(self) -> TrainPass:
        return self

    def __next__(self) -> Any:
        run = self._run
        driver = run._driver
        if run._state != "active" or run._save is not None:  # once a batch: checks inlined
            run._require("run.train(...)")
        if driver.epoch != self._epoch:
            raise RuntimeError(
                f"A `run.train(...)` iterator of epoch {self._epoch} used after epoch "
                f"{driver.epoch} started: iterate `run.train(loader)` once per epoch. {ORDER}"
            )
        if run._eval is not None:
            run._close_eval()
        driver.fetch_start()
        try:
            batch = next(self._iterator)
        except StopIteration:  # the epoch ends at the next epoch start or the fit's end
            self.exhausted = True
            raise
        self.yielded += 1
        driver.fetch_end_batch_start()
        probe = driver._steps.batch_probe
        if probe is not None:  # the first train batches, for the guards that read them
            probe(batch)
        return batch


class EvalLoader:
    """An eval loader wrapped by :meth:`Run.eval`; one iteration is one evaluation."""

    def __init__(self, run: Any, facts: LoaderFacts) -> None:
        self._run = run
        self.facts = facts

    def __len__(self) -> int:
        length = len(self.facts.loader)
        cap = self.facts.num_batches
        return length if cap is None else min(length, cap)

    def __iter__(self) -> Iterator[Any]:
        run = self._run
        run._require("run.eval(...)")
        run._close_eval()
        run._driver.eval_start([self.facts])
        it = EvalPass(run, self.facts)
        run._eval = it
        return it


class EvalPass:
    """One evaluation's pass over an eval loader: the batches it started, whether it ran out."""

    def __init__(self, run: Any, facts: LoaderFacts) -> None:
        self._run = run
        self.facts = facts
        self._iterator = iter(facts.loader)
        self.started = 0
        self._ended = False
        self._exhausted = False
        self._ran_out = False  # the loader's own iterator raised StopIteration

    def __iter__(self) -> EvalPass:
        return self

    def __next__(self) -> Any:
        run = self._run
        if self._ended:
            if self._exhausted:
                raise StopIteration
            raise RuntimeError(
                f"Eval of {self.facts.name!r} was already ended when the loop moved on; "
                f"iterate `run.eval(loader)` again for a new evaluation. {ORDER}"
            )
        run._require("run.eval(...)")
        driver = run._driver
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
        run = self._run
        run._eval = None
        if early:
            facts = self.facts
            run._driver.evals[0] = LoaderFacts(facts.name, facts.loader, False, self.started)
        run._driver.eval_end(LoaderPass(self.started, self._ran_out))


class Save:
    """The context manager of :meth:`Run.checkpoint`."""

    def __init__(self, run: Any, directories: list[str]) -> None:
        self._run = run
        self.directories = directories
        self._entered = False

    def __enter__(self) -> Save:
        run = self._run
        if self._entered or run._save is not None:
            raise RuntimeError(
                "`run.checkpoint(...)` entered while a save is in progress (saves do not "
                f"nest, and each `run.checkpoint(...)` is entered once). {ORDER}"
            )
        run._require("run.checkpoint(...)")
        self._entered = True
        run._close_eval()
        driver = run._driver
        try:
            driver.save_start(self.directories, model=run._model)
        except BaseException:
            driver.saving = False
            raise
        run._save = self
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        run = self._run
        run._save = None
        if exc is None and run._state == "active":
            run._driver.save_end()
        else:
            run._driver.saving = False
