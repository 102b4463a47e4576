"""Lightning's own words: its settings and calls as rankguard's messages name them.

The fixes the guards print (in Lightning's terms, not rankguard's), the
settings that make a strategy save sharded, and Lightning's defaults under the
user's guard settings. Plain values: the adapter
(:mod:`rankguard.integrations.lightning.adapter`) and the facts
(:mod:`rankguard.integrations.lightning.facts`) hand them to the guards.
"""

from __future__ import annotations

from rankguard.callbacks.checkpoint.plan import register_sharded_setting
from rankguard.callbacks.core.events import SplitDecision

ENFORCE_UNSUPPORTED = (
    "`drop_last_guard` `mode='enforce'` is not available under Lightning: Lightning counts "
    "the train batches of an epoch before any callback hook runs, so a loader shortened "
    "from a callback ends the epoch early and skips its end-of-epoch validation. Fix: build "
    "the train loader with DataLoader(..., drop_last=True) (Lightning's DistributedSampler "
    "follows it), and keep `mode='check'`."
)

#: Lightning writes checkpoints through an in-memory buffer (``_atomic_save``).
LIGHTNING_DEFAULTS = {"checkpoint_planner": {"writer": "buffer"}}


#: Lightning's settings for sharded checkpoints, named in rankguard's messages.
FSDP_SHARDED_SETTING = "FSDPStrategy(state_dict_type='sharded')"
MODEL_PARALLEL_SHARDED_SETTING = "ModelParallelStrategy(save_distributed_checkpoint=True)"
register_sharded_setting("Lightning", FSDP_SHARDED_SETTING)


#: Lightning's remote checkpoint storage, named in rankguard's messages as the fix for
#: node-local checkpoint folders.
UPLOAD_SETTING = (
    "save to and resume from remote storage through fsspec "
    "(`ModelCheckpoint(dirpath='s3://bucket/run/checkpoints')`, "
    "`trainer.fit(..., ckpt_path='s3://bucket/run/checkpoints/last.ckpt')`)"
)


#: How to resume every rank from one checkpoint, and keep each rank's data position, in
#: Lightning's words (the resume check's messages).
RESUME_FIX = (
    "resolve the checkpoint once for every node: `ModelCheckpoint(dirpath=...)` on storage every "
    "node mounts or on remote storage (fsspec, 's3://...') with `ckpt_path='last'`, or pass every "
    "rank the same path, `trainer.fit(..., ckpt_path=...)`"
)
DATA_FIX = (
    "Lightning saves a stateful train loader's `state_dict()` from rank 0 only and loads it on "
    "every rank: return every rank's position from it (e.g. gathered with "
    "`torch.distributed.all_gather_object`, by rank) and take this rank's in `load_state_dict()`"
)


#: How the hang verdict tells Lightning's decisions where they split the ranks.
SPLIT_DECISIONS = {
    "should_stop": SplitDecision(
        fix=(
            "reduce the decision across ranks, e.g. Lightning's "
            "`trainer.strategy.reduce_boolean_decision`, or base it on a metric synced across "
            "ranks"
        )
    ),
    "sync_dist_keys": SplitDecision(
        told="logged with sync_dist=True{at}: {value}", now=True, context="sync_dist_loop"
    ),
}
