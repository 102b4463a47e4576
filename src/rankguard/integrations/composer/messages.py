"""Composer's own words in rankguard's messages: its settings and fixes, as a user writes them."""

from __future__ import annotations

from rankguard.callbacks.checkpoint.plan import register_sharded_setting

__all__ = [
    "DATA_FIX",
    "LOSS_FIX",
    "LOSS_REDUCTION",
    "RESUME_FIX",
    "SHARDED_SETTING",
    "UPLOAD_SETTING",
]

#: Composer's loss reduction, in rankguard's message when ranks' loss keys differ.
LOSS_REDUCTION = "Composer's loss reduction (one all_reduce per loss key)"
#: What a user changes when the keys of the loss dict differ between ranks.
LOSS_FIX = (
    "return the same keys from the model's loss() on every rank and every batch (a zero "
    "tensor for a term a rank's batch has nothing for, e.g. torch.zeros((), device=...)); "
    "Composer all-reduces each key of the loss dict, in order, after every batch."
)

#: Composer's remote checkpoint storage, named in rankguard's messages as the fix for
#: node-local checkpoint folders.
UPLOAD_SETTING = (
    "save to and resume from remote storage: Composer uploads every checkpoint with a remote "
    "`save_folder` (e.g. `save_folder='s3://bucket/run/checkpoints'`) and downloads on every "
    "node with a remote `load_path`"
)


#: How to resume every rank from one checkpoint, and keep each rank's data position, in Composer.
RESUME_FIX = (
    "give every node the same newest checkpoint: autoresume loads rank 0's "
    "`<save_folder>/latest-rank0.pt` as each node sees it, so save to remote storage (a remote "
    "`save_folder`, which Composer downloads on every node) or a folder every node mounts"
)
DATA_FIX = (
    "Composer saves the train dataset's `state_dict(num_samples, from_beginning)` of the rank "
    "that writes the checkpoint and loads it into every rank's dataset: return a state that "
    "holds for every rank (a global sample count, as StreamingDataset does)"
)


#: Composer's setting for sharded checkpoints (FSDP), named in rankguard's messages.
SHARDED_SETTING = "parallelism_config={'fsdp': {'state_dict_type': 'sharded'}}"
register_sharded_setting("Composer", SHARDED_SETTING)
