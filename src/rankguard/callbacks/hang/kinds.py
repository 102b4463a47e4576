"""The hang watchdog's phase kinds: each has its own deadline (``done``, after fit end, none).

One vocabulary for the deadlines, the calibration and the heartbeats' reading. A member is the
kind's name as a string (it formats, prints and reprs as one): in log lines, in the
checkpoint's calibration and in the dicts of deadlines a user reads, the text is unchanged.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Phase"]


class Phase(str, Enum):
    """The kind of phase a rank is in, which says the deadline that applies.

    The training loop, by the heartbeat after which each applies::

        fit_start                        STARTUP     (until the first train batch ends)
        data_fetch_start                 DATA
        data_fetch_end, train_batch_*    TRAIN
        eval_start, eval_batch_*         EVAL
        eval_end                         POST_EVAL   (until the loop fetches again)
        checkpoint_save_start            CHECKPOINT
        fit_end                          DONE        (no deadline)
    """

    STARTUP = "startup"
    TRAIN = "train"
    DATA = "data"
    EVAL = "eval"
    POST_EVAL = "post_eval"
    CHECKPOINT = "checkpoint"
    DONE = "done"

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)

    def __repr__(self) -> str:
        return repr(str.__str__(self))
