"""The facts the guards need, read from Composer's public ``State`` and ``Logger``.

The train loader, each evaluator's loader and planned batch count, the
checkpoint savers' folders and uploads, the train dataset's position, the
switch to sharded saves, and the pass counter handed to the loader Composer
iterates next: :func:`event_facts` reads what each core event needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from composer.callbacks import CheckpointSaver
from composer.core import State
from composer.loggers import Logger, RemoteUploaderDownloader
from composer.utils import format_name_with_dist

from rankguard.callbacks.batches.loader_passes import PassCounter
from rankguard.callbacks.core.events import Event as CoreEvent
from rankguard.callbacks.core.events import EventFacts, LoaderFacts
from rankguard.callbacks.core.step_log import BACKWARD, BACKWARD_END, OPTIMIZER_STEP
from rankguard.integrations.composer.decisions import countable
from rankguard.integrations.composer.messages import SHARDED_SETTING, UPLOAD_SETTING
from rankguard.integrations.private.composer import trainer_load_path

__all__ = [
    "PHASES",
    "as_int",
    "checkpoint_savers",
    "checkpoint_uploads",
    "dataset_positions",
    "event_facts",
    "observe_pass",
    "save_directories",
    "sharded_switch",
    "train_loader_facts",
]

#: The parts of a train batch Composer announces: each microbatch's backward, its end, and
#: AFTER_TRAIN_BATCH (the microbatches done, the optimizer steps next).
PHASES = (BACKWARD, BACKWARD_END, OPTIMIZER_STEP)

_EVAL_EVENTS = (
    CoreEvent.EVAL_START,
    CoreEvent.EVAL_BATCH_START,
    CoreEvent.EVAL_BATCH_END,
    CoreEvent.EVAL_END,
)


def train_loader_facts(loader: Any, length: Any) -> LoaderFacts | None:
    """The train loader's facts from Composer's loader and its ``dataloader_len``."""
    if loader is None:
        return None
    return LoaderFacts("train", loader, is_train=True, num_batches=as_int(length))


def _train_loader(state: State) -> LoaderFacts | None:
    return train_loader_facts(state.train_dataloader, state.dataloader_len)


def _evaluator_loaders(state: State) -> list[LoaderFacts]:
    facts = []
    for evaluator in state.evaluators:
        loader = evaluator.dataloader.dataloader
        planned = None
        subset = evaluator.subset_num_batches
        if subset is not None and subset > 0:
            try:
                planned = min(subset, len(loader))
            except TypeError:
                planned = None
        facts.append(LoaderFacts(evaluator.label, loader, is_train=False, num_batches=planned))
    return facts


def checkpoint_savers(state: State) -> list[CheckpointSaver]:
    """Composer's checkpoint savers, among the ``State``'s callbacks."""
    return [cb for cb in state.callbacks if isinstance(cb, CheckpointSaver)]


def save_directories(state: State) -> list[str]:
    """The local folders Composer's checkpoint savers write to (formatted per rank)."""
    return [
        format_name_with_dist(saver.folder, state.run_name) for saver in checkpoint_savers(state)
    ]


def checkpoint_uploads(state: State, logger: Logger) -> dict[str, str]:
    """The save folders whose checkpoints Composer also uploads, and where to.

    A remote ``save_folder`` (``s3://bucket/run``) makes the saver stage each
    checkpoint in a local temporary folder and upload it; a
    ``RemoteUploaderDownloader`` logger uploads what a saver with a
    ``remote_file_name`` saves.
    """
    remote = [d for d in logger.destinations if isinstance(d, RemoteUploaderDownloader)]
    uploads = {}
    for saver in checkpoint_savers(state):
        folder = format_name_with_dist(saver.folder, state.run_name)
        if saver.remote_uploader is not None:
            uploads[folder] = str(saver.remote_uploader.remote_folder)
        elif saver.remote_file_name is not None and remote:
            uploads[folder] = f"{remote[0].remote_backend_name}://{remote[0].remote_bucket_name}"
    return uploads


def dataset_positions(state: State) -> dict[str, Any]:
    """Composer's own train data position: what it saves as ``dataset_state['train']``."""
    method = getattr(getattr(state.train_dataloader, "dataset", None), "state_dict", None)
    if not callable(method):
        return {}
    try:  # a state_dict() without Composer's arguments is read by the guard itself
        return {"train dataset_state": method(int(state.timestamp.sample_in_epoch), True)}
    except TypeError:
        return {}


def sharded_switch(state: State) -> Callable[[], str] | None:
    """How to make this job's later saves sharded, or ``None`` without FSDP.

    Composer reads ``fsdp_config.state_dict_type`` at every save, so changing it
    at FIT_START changes every save of this fit.
    """
    config = state.fsdp_config
    if config is None or not state.fsdp_enabled:
        return None

    def switch() -> str:
        config.state_dict_type = "sharded"
        return f"set Composer's {type(config).__name__}.state_dict_type to 'sharded'"

    return switch


def observe_pass(state: State) -> PassCounter | None:
    """Hands Composer a :class:`PassCounter` for the loader it iterates next, if it may.

    Called at ``EPOCH_START`` and ``EVAL_START``, after which Composer iterates
    ``state.dataloader`` (public: ``State.set_dataloader`` replaces it, with
    the same label and batch count). Composer stops every rank as soon as one
    runs out of data, so only the loader's own iterator tells a rank that ran
    out from one that still had data. A loader with a ``DistributedSampler``
    is left as it is: Composer looks for that sampler on a ``DataLoader`` (to
    set its epoch), and its batches are counted before the first batch anyway.

    Returns:
        The counter now in ``state.dataloader``, or ``None``.
    """
    loader = state.dataloader
    if not countable(loader):
        return None
    counter = PassCounter(loader)
    length = state.dataloader_len
    state.set_dataloader(counter, state.dataloader_label, -1 if length is None else int(length))
    return counter


def as_int(value: Any) -> int | None:
    """``value`` as an ``int`` (Composer's ``Time``, or an int), or ``None``."""
    return None if value is None else int(value)


def event_facts(event: CoreEvent, state: State, logger: Logger) -> EventFacts:
    """Reads the facts a core event needs from Composer's ``State``."""
    timestamp = state.timestamp
    step, epoch = timestamp.batch.value, timestamp.epoch.value
    facts = EventFacts(step=step, epoch=epoch)
    if event is CoreEvent.CHECKPOINT_LOAD_START:
        facts.load_path = trainer_load_path()
        facts.upload_setting = UPLOAD_SETTING
    elif event is CoreEvent.FIT_START:
        train = _train_loader(state)
        facts.loaders = ([train] if train else []) + _evaluator_loaders(state)
        facts.model = state.model
        facts.optimizer = state.optimizers[0] if state.optimizers else None
        facts.directories = save_directories(state)
        facts.state_dict_type = state.fsdp_state_dict_type or "full"
        facts.switch_to_sharded = sharded_switch(state)
        facts.sharded_setting = SHARDED_SETTING
        facts.uploads = checkpoint_uploads(state, logger)
        facts.upload_setting = UPLOAD_SETTING
        facts.phases = PHASES
    elif event is CoreEvent.CHECKPOINT_SAVE_START:
        facts.model = state.model
        facts.directories = save_directories(state)
        facts.positions = dataset_positions(state)  # as saved
    elif event is CoreEvent.EPOCH_END:
        facts.epoch -= 1  # Composer counts the epoch as done before EPOCH_END
        facts.loader = _train_loader(state)
    elif event in (CoreEvent.EPOCH_START, CoreEvent.DATA_FETCH_START):
        # DATA_FETCH_START: Composer's window also holds an all_reduce over the ranks, so
        # the data-stall monitor times the loader's own return (see callbacks/data/data_fetch.py).
        facts.loader = _train_loader(state)
    elif event in _EVAL_EVENTS:
        loader = state.dataloader
        facts.loader = LoaderFacts(
            str(state.dataloader_label),
            loader.loader if isinstance(loader, PassCounter) else loader,
            is_train=False,
            num_batches=as_int(state.dataloader_len),
        )
        # Composer counts the batch as done before EVAL_BATCH_END: it ran the one before.
        done = int(state.eval_timestamp.batch)
        facts.batch_index = done - 1 if event is CoreEvent.EVAL_BATCH_END else done
    return facts
