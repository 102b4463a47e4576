"""The Hugging Face Trainer's objects read into rankguard's facts, and its words for each fix.

What the adapter (:mod:`rankguard.integrations.transformers.adapter`) hands the
guards: the loaders, checkpoint folders, state dict type, a resume's checkpoint
and what it restored, the stop decision the hang watchdog reads; and the
Trainer's own settings named in rankguard's messages (:data:`SHARDED_SETTING`,
:data:`SPLIT_DECISIONS`, :data:`RESUME_FIX`, :data:`DATA_FIX`). Everything here
reads public names; the private ones are read in
``rankguard.integrations.private.transformers``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from rankguard.callbacks.core.events import LoaderFacts, ResumeFacts, SplitDecision
from rankguard.integrations.private.transformers import LoopPosition
from rankguard.integrations.transformers.decisions import resume_loader

#: What makes the Trainer's FSDP saves sharded, named in rankguard's messages.
SHARDED_SETTING = (
    "FSDP with sharded state dicts: FSDP_STATE_DICT_TYPE=SHARDED_STATE_DICT "
    "(Accelerate config `fsdp_state_dict_type: SHARDED_STATE_DICT`)"
)
#: accelerate's loader where rank 0 reads every batch and sends each rank its own (the
#: default for an iterable dataset, ``dispatch_batches``): other ranks' positions mean nothing.
DISPATCHER = "DataLoaderDispatcher"


def train_loader(train_dataloader: Any) -> LoaderFacts | None:
    """The train loader the Trainer hands ``on_train_begin``, as facts (``None`` without one).

    Read by each rank unless it is accelerate's :data:`DISPATCHER`.
    """
    if train_dataloader is None:
        return None
    own = type(train_dataloader).__name__ != DISPATCHER  # each rank reads its own
    return LoaderFacts("train", train_dataloader, True, read_by_each_rank=own)


def eval_loader_names(eval_dataset: Any) -> list[tuple[str, str | None]]:
    """The Trainer's eval datasets as (rankguard loader name, ``get_eval_dataloader`` key).

    One dataset is ``"eval"``; a dict of them ``"eval_<name>"``, as the Trainer
    prefixes their metrics, in the order it evaluates them.
    """
    if eval_dataset is None:
        return []
    if isinstance(eval_dataset, Mapping):
        return [(f"eval_{name}", str(name)) for name in eval_dataset]
    return [("eval", None)]


def checkpoint_folder(args: TrainingArguments, state: TrainerState) -> str:
    """The folder the Trainer's next save writes into (``output_dir/checkpoint-<step>``)."""
    return os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


def data_parallel(trainer: Trainer | None) -> Any:
    """What makes the model data parallel: the Trainer's ``model_wrapped`` (DDP under DDP)."""
    return getattr(trainer, "model_wrapped", None)


def state_dict_type(trainer: Trainer | None) -> str:
    """``"sharded"`` when the Trainer's FSDP saves sharded state dicts, else ``"full"``."""
    if trainer is None or not getattr(trainer, "is_fsdp_enabled", False):
        return "full"
    plugin = trainer.accelerator.state.fsdp_plugin
    return "sharded" if "SHARDED" in str(plugin.state_dict_type).upper() else "full"


def resume_checkpoint(args: TrainingArguments, resume: str | bool) -> str:
    """What ``Trainer.train(resume_from_checkpoint=resume)`` reads first on this rank.

    The checkpoint's ``trainer_state.json``, which ``train`` reads right after
    the model, so a folder that holds only this rank's RNG state (what a rank
    saves on a node other than rank 0's, without ``save_on_each_node``) counts
    as missing. ``True`` means the latest ``checkpoint-<step>`` in ``output_dir``
    on this node, as the Trainer finds it; where there is none, a
    ``checkpoint-*`` that does not exist.
    """
    if resume is True:
        output_dir = str(args.output_dir)
        found = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        folder = found or os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-*")
    else:
        folder = str(resume)
    return os.path.join(folder, TRAINER_STATE_NAME)


#: How the hang verdict tells the Trainer's stop decision where it split the ranks.
SPLIT_DECISIONS = {
    "should_training_stop": SplitDecision(
        fix=(
            "reduce the metric across ranks before deciding, e.g. `EarlyStoppingCallback` on "
            "the metrics `trainer.evaluate()` returns, already gathered from every rank, or set "
            "`control.should_training_stop` on every rank alike"
        )
    )
}


def stop_decision(control: TrainerControl) -> dict[str, Any]:
    """``control.should_training_stop`` as a decision that can split the ranks.

    Read by the hang watchdog's thread while a rank is blocked: early stopping
    decided from one rank's un-gathered metric stops that rank alone
    (transformers #17478). The Trainer keeps one ``TrainerControl`` per run.
    """
    return {"should_training_stop": bool(control.should_training_stop)}


RESUME_FIX = (
    "resume every rank from the same checkpoint: `trainer.train(resume_from_checkpoint=<path>)` "
    "with a checkpoint-<step> folder every node mounts, or copy the newest checkpoint folder "
    "into every node's `output_dir` before the restart (`resume_from_checkpoint=True` takes "
    "the newest one each node sees in its own `output_dir`)"
)
DATA_FIX = (
    "save each rank's own data position (a file per rank, e.g. named by `args.process_index`, "
    "written on every rank, not only where `state.is_world_process_zero`) and load each rank's "
    "own; or leave the position to the Trainer, which skips the trained batches "
    "(`ignore_data_skip=False`)"
)


def resume_facts(
    args: TrainingArguments,
    state: TrainerState,
    asked: tuple[str, str | bool],
    position: LoopPosition,
    train: LoaderFacts | None,
) -> ResumeFacts:
    """What a resumed ``train`` restored, at its first ``on_step_begin`` (RESUMED).

    ``asked``: the checkpoint folder as :func:`resume_checkpoint` resolved it, and
    ``resume_from_checkpoint`` as passed; ``position``: the Trainer's loop counters
    (``loop_position``). The checkpoint counts as loaded where its
    ``trainer_state.json`` is; the batches skipped are 0 with ``ignore_data_skip``.
    """
    folder, resume = asked
    counters = {"global_step": state.global_step, "epoch": position.epoch}
    if position.skipped is not None:
        counters["batches skipped"] = 0 if args.ignore_data_skip else position.skipped
    return ResumeFacts(
        asked=f"resume_from_checkpoint={resume!r}",
        checkpoint=folder if os.path.isfile(os.path.join(folder, TRAINER_STATE_NAME)) else None,
        counters=counters,
        loader=resume_loader(train, position.loader),
        folder=str(args.output_dir) if resume is True else None,
        restores_rng=True,
        fix=RESUME_FIX,
        data_fix=DATA_FIX,
    )
