"""What the OLMo-core adapter reads from OLMo-core's objects, and OLMo-core's words for fixes.

The facts the guards need: the checkpoint a load reads, the evaluators and their
planned batches, the save folder, what a save writes and how to make it sharded,
what a resume loaded. Each reads OLMo-core's public objects
(its private names are read in :mod:`rankguard.integrations.private.olmo_core`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from typing import Any

from olmo_core.eval import Evaluator
from olmo_core.io import is_url
from olmo_core.train import Trainer
from olmo_core.train.callbacks import CheckpointerCallback, EvaluatorCallback
from olmo_core.train.common import DurationUnit

from rankguard.callbacks.core.events import LoaderFacts, ResumeFacts
from rankguard.integrations.olmo_core.decisions import resumed_from_load_path

__all__ = [
    "DEFAULTS",
    "RESUME_DATA_FIX",
    "RESUME_FIX",
    "SHARDED_SETTING",
    "UPLOAD_SETTING",
    "checkpoint_to_load",
    "eval_facts",
    "evaluators",
    "planned_eval_batches",
    "resume_facts",
    "save_folder",
    "save_options",
    "sharded_switch",
]

#: Where OLMo-core saves checkpoints every node can read, named in rankguard's messages.
UPLOAD_SETTING = (
    "save to remote storage: TrainerConfig(save_folder='s3://...') (or gs://, r2://, weka://), "
    "or give the resume as TrainerConfig(load_path=<URL>)"
)
#: OLMo-core's setting that makes its checkpointer's saves sharded (the default) or full.
SHARDED_SETTING = (
    "TransformerTrainModuleConfig(state_dict_save_opts={'full_state_dict': False, "
    "'cpu_offload': True, 'flatten_optimizer_state_dict': True})"
)
#: How an OLMo-core job resumes every rank from one checkpoint, and keeps each rank's own state.
RESUME_FIX = (
    "resume every rank from one copy: TrainerConfig(save_folder=...) on storage every node "
    "mounts (OLMO_SHARED_FS=1 only where it is shared) or a URL (s3://, gs://), or the same "
    "checkpoint copied to every node before the restart"
)
RESUME_DATA_FIX = (
    "keep every rank's train/rank{N}.pt in the checkpoint: where a rank's file is missing, "
    "OLMo-core's Checkpointer.load restores train/rank0.pt (rank 0's data loader state and "
    "random states) on that rank"
)
#: OLMo-core's own guard settings. A local save folder must be shared by every node (its
#: Trainer refuses one that is not unless ``OLMO_SHARED_FS=1`` says it is). Python ``random``
#: and numpy states differ between ranks in a healthy run: OLMo-core draws from ``random`` on
#: the rank that writes its data indices, and a resume restores each rank's own states; its
#: data order comes from the data loader's ``seed`` (datasets are still compared).
DEFAULTS: dict[str, dict[str, Any]] = {
    "shared_dir_barrier": {"on_node_local": "raise"},
    "data_consistency_guard": {"check_rng": False},
}


def checkpoint_to_load(trainer: Trainer, folder: str) -> str:
    """The checkpoint ``trainer.load_checkpoint(folder)`` reads, as this rank sees it.

    ``folder`` itself if it is a checkpoint, else its latest ``step<N>``, the
    way OLMo-core's rank 0 finds it; where this rank finds none, a ``step*``
    that does not exist (so a node without it is named). A URL is given back
    as it is (every node reads the same remote storage).
    """
    folder = str(folder)
    checkpointer = trainer.checkpointer
    if is_url(folder) or checkpointer.dir_is_checkpoint(folder):
        return folder
    try:
        return str(checkpointer.latest_checkpoint(folder))
    except FileNotFoundError:
        return os.path.join(folder, "step*")


def planned_eval_batches(evaluator: Evaluator, callback: EvaluatorCallback) -> int | None:
    """The batches ``callback`` runs of ``evaluator``: its length, cut by ``eval_duration``."""
    total = evaluator.total_batches
    duration = callback.eval_duration
    if duration.unit == DurationUnit.steps:
        return duration.value if total is None else min(total, duration.value)
    if duration.unit == DurationUnit.epochs and duration.value == 1:
        return total
    return None  # a token budget: known only as it runs


def evaluators(trainer: Trainer) -> list[tuple[Evaluator, EvaluatorCallback]]:
    """The evaluators the Trainer's ``EvaluatorCallback`` instances run (none with ``no_evals``)."""
    if trainer.no_evals:
        return []
    return [
        (evaluator, callback)
        for callback in trainer.callbacks.values()
        if isinstance(callback, EvaluatorCallback)
        for evaluator in callback.evaluators
    ]


def eval_facts(
    watched: Iterable[tuple[Evaluator, EvaluatorCallback]],
) -> dict[int, LoaderFacts]:
    """Each of :func:`evaluators`' evaluators as an eval loader, by ``id(evaluator)``."""
    return {
        id(evaluator): LoaderFacts(
            evaluator.name,
            evaluator.batches,
            is_train=False,
            num_batches=planned_eval_batches(evaluator, callback),
        )
        for evaluator, callback in watched
    }


def save_folder(trainer: Trainer) -> str | None:
    """Where the Trainer's checkpoints go, or ``None`` if it saves none."""
    checkpointers = [c for c in trainer.callbacks.values() if isinstance(c, CheckpointerCallback)]
    if trainer.no_checkpoints or not any(c.enabled for c in checkpointers):
        return None
    return str(trainer.save_folder)


def save_options(train_module: Any) -> tuple[str, bool]:
    """What the checkpointer's saves are, from the train module's public save options.

    OLMo-core's checkpointer always writes through ``torch.distributed.checkpoint``;
    what it writes is ``train_module.state_dict_to_save()``, built with the
    ``state_dict_save_opts`` of ``TransformerTrainModuleConfig`` (default
    ``full_state_dict=False, cpu_offload=True``): a sharded save, each rank its own
    part. ``full_state_dict=True`` makes it a full (unsharded) model export,
    consolidated on rank 0. The one place rankguard reads that attribute;
    ``tests/integrations/test_olmo_core.py`` fails if OLMo-core changes it.

    Returns:
        ``("full" | "sharded", copies_to_host)``: ``copies_to_host`` when
        ``cpu_offload`` builds the whole state dict in host memory before writing.
        A train module without those options (``BasicTrainModule``) saves sharded,
        offloaded to the host.
    """
    options = getattr(train_module, "state_dict_save_opts", None)
    if options is None:
        return "sharded", True
    kind = "full" if options.full_state_dict else "sharded"
    return kind, bool(options.cpu_offload)


def sharded_switch(train_module: Any) -> Callable[[], str] | None:
    """Makes the train module's later saves sharded, for ``CheckpointPlanner(mode="auto")``.

    ``None`` where it has no ``state_dict_save_opts`` to change. OLMo-core reads
    them at every save.
    """
    if getattr(train_module, "state_dict_save_opts", None) is None:
        return None

    def switch() -> str:
        options = train_module.state_dict_save_opts
        train_module.state_dict_save_opts = dataclasses.replace(options, full_state_dict=False)
        return f"set {type(train_module).__name__}.state_dict_save_opts.full_state_dict to False"

    return switch


def resume_facts(trainer: Trainer, checkpoint: str | None) -> ResumeFacts:
    """What this rank resumed from: ``checkpoint`` (``None``: a fresh start), counters, loader."""
    folder, load_path = str(trainer.save_folder), trainer.load_path
    from_load_path = resumed_from_load_path(checkpoint, load_path, folder)
    loader = trainer.data_loader
    counters = {"global_step": trainer.global_step, "epoch": trainer.epoch}
    if isinstance(batches := getattr(loader, "batches_processed", None), int):
        counters["batches_processed"] = batches
    return ResumeFacts(
        f"load_path={str(load_path)!r}" if from_load_path else f"save_folder={folder!r} (latest)",
        checkpoint,
        counters,
        loader=loader,
        folder=None if from_load_path else folder,
        restores_rng=True,  # Trainer.load_state_dict, from the same world size
        fix=RESUME_FIX,
        data_fix=RESUME_DATA_FIX,
    )
