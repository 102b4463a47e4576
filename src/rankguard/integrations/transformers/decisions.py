"""What the Hugging Face Trainer adapter decides, as pure functions of the Trainer's flags.

Which event comes next after a step or an epoch's end (:func:`next_event`),
which save may follow an eval (:func:`save_after_eval`), and which loader a
resume's data position is read from (:func:`resume_loader`). Each has a unit
test in ``tests/integrations/test_transformers.py``; the adapter
(:mod:`rankguard.integrations.transformers.adapter`) announces what they decide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainingArguments

    from rankguard.callbacks.core.events import LoaderFacts


def next_event(control: TrainerControl, after_step: bool) -> str | None:
    """What the Trainer does after a train step (``after_step``) or an epoch's end.

    ``"eval"`` (a save due as well waits for the eval's ``on_evaluate``), ``"save"``,
    ``"log"`` after a step (the Trainer gathers the loss, then fetches), ``"fetch"``
    after a step, else ``None``.
    """
    if control.should_evaluate:
        return "eval"
    if control.should_save:
        return "save"
    if after_step:
        return "log" if control.should_log else "fetch"
    return None


def save_after_eval(control: TrainerControl, args: TrainingArguments) -> str | None:
    """Which save may follow the Trainer's last eval: ``"step"``, ``"best"`` or ``None``.

    The Trainer decides a "best" save only after ``on_evaluate``: with
    ``save_strategy="best"`` a save may follow any eval (into ``output_dir``).
    """
    if control.should_save:
        return "step"
    return "best" if args.save_strategy == "best" else None


def resume_loader(train: LoaderFacts | None, epoch_loader: Any) -> Any:
    """The loader a resume's data position is read from: the epoch's, else the train loader's.

    ``None`` without a train loader or where one rank reads for all
    (:data:`~rankguard.integrations.transformers.facts.DISPATCHER`).
    """
    if train is None or not train.read_by_each_rank:
        return None
    return epoch_loader if epoch_loader is not None else train.loader
