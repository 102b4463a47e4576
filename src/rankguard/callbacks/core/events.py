"""rankguard's event vocabulary: the training loop as the core guards see it.

Holds :class:`Event`, the events, and :class:`EventFacts`, what each one carries.
See docs/design.md#events-the-training-loop-as-the-guards-see-it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["Event", "EventFacts", "LoaderFacts", "LoaderPass", "ResumeFacts", "SplitDecision"]


class Event(str, Enum):
    """One point of the training loop.

    Where each comes from, per framework:
    docs/design.md#events-the-training-loop-as-the-guards-see-it.
    """

    CHECKPOINT_LOAD_START = "checkpoint_load_start"
    FIT_START = "fit_start"
    RESUMED = "resumed"
    EPOCH_START = "epoch_start"
    DATA_FETCH_START = "data_fetch_start"
    DATA_FETCH_END = "data_fetch_end"
    TRAIN_BATCH_START = "train_batch_start"
    TRAIN_BATCH_END = "train_batch_end"
    EVAL_START = "eval_start"
    EVAL_BATCH_START = "eval_batch_start"
    EVAL_BATCH_END = "eval_batch_end"
    EVAL_END = "eval_end"
    CHECKPOINT_SAVE_START = "checkpoint_save_start"
    CHECKPOINT_SAVE_END = "checkpoint_save_end"
    EPOCH_END = "epoch_end"
    FIT_END = "fit_end"


@dataclass
class LoaderFacts:
    """A data loader as a guard sees it.

    Attributes:
        name: The framework's name for it (``"train"``, a Composer evaluator
            label, a Lightning val loader name such as ``"val/1"``).
        loader: The user's loader object (a ``torch.utils.data.DataLoader``
            or any iterable). Guards must never iterate it.
        is_train: Whether it feeds training (else evaluation).
        num_batches: The number of batches the framework plans to run from it
            in one pass (after its own limits such as Composer's
            ``eval_subset_num_batches`` or Lightning's ``limit_val_batches``),
            or ``None`` when unknown; then guards fall back to ``len(loader)``.
        read_by_each_rank: Whether each rank reads its own data from ``loader``
            (``False``: one rank reads for all and sends each its batches, as
            accelerate's ``DataLoaderDispatcher``: the others' positions mean nothing).
    """

    name: str
    loader: Any
    is_train: bool
    num_batches: int | None = None
    read_by_each_rank: bool = True


@dataclass(frozen=True)
class SplitDecision:
    """How a decision of :attr:`EventFacts.decisions` is told where it split the ranks.

    The adapter knows its framework's words; the hang verdict only compares values.

    Attributes:
        told: What a rank holding it did, with ``{value}`` (its names, joined) and
            ``{at}`` (" at step N"), e.g. ``"logged with sync_dist=True{at}: {value}"``;
            ``None``: ``"set NAME at step N"``.
        fix: For a stop decision (one that ends training on the rank that sets it):
            how to decide it alike on every rank; ``None`` for any other decision.
        now: Whether the value belongs to the step the rank is in now (names logged
            in the step), rather than the step at which it last changed.
        context: Another decision that must be alike on two ranks for this one to
            be compared (e.g. the loop the names were logged in).
    """

    told: str | None = None
    fix: str | None = None
    now: bool = False
    context: str | None = None


@dataclass(frozen=True)
class LoaderPass:
    """What one pass over a loader's iterator did on this rank, as an adapter saw it.

    Attributes:
        yielded: Batches the iterator returned (a framework that stops every
            rank when one runs out may have fetched one it then did not run).
        exhausted: Whether the iterator ran out (raised ``StopIteration``),
            rather than the framework stopping before its end.
    """

    yielded: int
    exhausted: bool


@dataclass
class ResumeFacts:
    """What one rank resumed from, as its framework restored it (RESUMED).

    Attributes:
        asked: How the job asked for the resume, in the framework's words
            (``"resume_from_checkpoint=True"``, ``"ckpt_path='last'"``), named in messages.
        checkpoint: The checkpoint this rank loaded (file or folder, as resolved on
            this rank), or ``None`` when it found none and started fresh.
        counters: The framework's counters after the load, under its names
            (``{"global_step": 8, "epoch": 1}``): they must match on every rank.
        loader: The train loader; its position (a stateful loader's, its dataset's or
            its sampler's ``state_dict``, a sampler's ``epoch``) is read by the guard.
        positions: Other data positions the adapter read, by name (a framework's
            own data-loader state): each a plain value.
        folder: Where the framework looked the checkpoint up (a save folder that
            "latest" is resolved in); ``None``: the checkpoint's parent.
        restores_rng: Whether the framework restores each rank's random state from the
            checkpoint (then the pattern at the save is what the resume must show).
        fix: How to resume every rank from the same checkpoint in this framework.
        data_fix: How to save and restore each rank's own data position in this
            framework (``None``: the generic words).
    """

    asked: str
    checkpoint: str | None
    counters: dict[str, int] = field(default_factory=dict)
    loader: Any = None
    positions: dict[str, Any] = field(default_factory=dict)
    folder: str | None = None
    restores_rng: bool = False
    fix: str | None = None
    data_fix: str | None = None


@dataclass
class EventFacts:
    """The plain facts that come with an event; unset fields are unknown.

    Attributes:
        step: Global index of the current train batch (0 before the first).
        epoch: Current epoch, from 0.
        loader: The loader the event is about (EPOCH_START, EPOCH_END: train; EVAL_*:
            the eval loader; DATA_FETCH_START: train, from adapters whose fetch
            window also holds a collective, so the batch's own arrival is timed).
        batch_index: Index of the batch within ``loader`` for batch events.
        loaders: Every loader known at FIT_START, train first.
        model: The model being trained (FIT_START).
        optimizer: Its (first) optimizer, if the framework has built it (FIT_START).
        data_parallel: What makes ``model`` data parallel, where the framework keeps it
            apart from ``model`` (Lightning's ``strategy.model``, the HF Trainer's
            ``model_wrapped``: a ``DistributedDataParallel``), or ``None`` (FIT_START).
        directories: Local directories checkpoints are saved to (FIT_START,
            CHECKPOINT_SAVE_START); the same number on every rank.
        state_dict_type: What the job's checkpoint saves are now, ``"full"``
            (one consolidated file) or ``"sharded"`` (a shard per rank), if known
            (FIT_START).
        switch_to_sharded: Makes the job's later saves sharded and returns what
            it changed; ``None`` where the job's set-up cannot save sharded
            checkpoints (FIT_START).
        sharded_setting: The framework's setting for sharded checkpoints, named
            in messages (FIT_START).
        save_copies_to_host: Whether a save first builds its whole state dict in
            host memory (OLMo-core's ``cpu_offload=True``): a full save's
            consolidated copy on rank 0, or each rank's own part of a sharded save
            (its whole replica where the model is not sharded) (FIT_START).
        uploads: Per directory of ``directories`` (as given there), the remote
            location the framework also uploads its checkpoints to (FIT_START).
        upload_setting: The framework's way to save or upload checkpoints to
            remote storage, named in messages (FIT_START).
        load_path: The checkpoint about to be loaded (CHECKPOINT_LOAD_START).
        resume: What this rank resumed from (RESUMED).
        positions: Data positions the framework holds beside the train loader, by
            name, as ``ResumeFacts.positions`` has them (CHECKPOINT_SAVE_START).
        loader_pass: What this rank's pass over ``loader`` did (EVAL_END,
            EPOCH_END), where the adapter could see the loader's iterator.
        decisions: Decisions that can split the ranks, as the framework holds
            them now (TRAIN_BATCH_END, EVAL_END), under the framework's names: a
            stop decision, the metric names logged with cross-rank sync in the step;
            ``split_decisions`` says how each is told.
        decision_probe: Returns ``decisions`` as they are now (FIT_START), for a
            guard's background thread to read while the loop is blocked (the
            decision that split the ranks may be made inside the step that hangs).
        split_decisions: How each name of ``decisions`` is told, and the fix of a stop
            decision, in the framework's words (FIT_START).
        phases: The parts of a train batch the adapter announces in the step log this fit
            (``step_log.SUBPHASES`` names: backward passes, optimizer steps), where its
            framework has them (FIT_START).
    """

    step: int = 0
    epoch: int = 0
    loader: LoaderFacts | None = None
    batch_index: int | None = None
    loaders: list[LoaderFacts] = field(default_factory=list)
    model: Any = None
    optimizer: Any = None
    data_parallel: Any = None
    directories: list[str] = field(default_factory=list)
    state_dict_type: str | None = None
    switch_to_sharded: Callable[[], str] | None = None
    sharded_setting: str | None = None
    save_copies_to_host: bool = False
    uploads: dict[str, str] = field(default_factory=dict)
    upload_setting: str | None = None
    load_path: str | None = None
    resume: ResumeFacts | None = None
    positions: dict[str, Any] = field(default_factory=dict)
    loader_pass: LoaderPass | None = None
    decisions: dict[str, Any] = field(default_factory=dict)
    decision_probe: Callable[[], dict[str, Any]] | None = None
    split_decisions: dict[str, SplitDecision] = field(default_factory=dict)
    phases: tuple[str, ...] = ()

    @staticmethod
    def for_loaders(loaders: Iterable[LoaderFacts], **kwargs: Any) -> EventFacts:
        """Builds FIT_START facts from loaders (train first)."""
        ordered = sorted(loaders, key=lambda lf: not lf.is_train)
        return EventFacts(loaders=ordered, **kwargs)
