"""The hang verdict, case by case: every proof and non-proof the suite stages, as plain statuses.

Each row is one state of a 2-rank job (or 4 ranks) as the ranks' watchdogs send it, judged
at two exchanges a second apart (a proof needs both), with the one right verdict: its class,
the ranks it names, the rank to read first, the exit code, and its first sentence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from rankguard.callbacks.core.events import SplitDecision
from rankguard.callbacks.core.step_log import (
    BACKWARD,
    BACKWARD_END,
    BACKWARD_OPTIMIZER_STEP,
    BATCH_END_FETCH_START,
    FETCH_END_BATCH_START,
    MICROBATCH,
    OPTIMIZER_STEP,
)
from rankguard.callbacks.hang.collective_compare import GroupRecord, Issued
from rankguard.callbacks.hang.deadlines import liveness
from rankguard.callbacks.hang.history import History, Phases
from rankguard.callbacks.hang.status import LEFT_LOOP, RankStatus, Verdict
from rankguard.callbacks.hang.verdict import diagnose, gone, sent_apart

WORDS = {
    "should_stop": SplitDecision(fix="reduce the decision across ranks"),
    "should_training_stop": SplitDecision(fix="gather the metric before deciding"),
    "sync_dist_keys": SplitDecision(
        told="logged with sync_dist=True{at}: {value}", now=True, context="sync_dist_loop"
    ),
}
EXCHANGE = "rankguard exchange, called from batch_parity_guard.py:331 (_compare_planned)"
ITEM = "train.py:90 (log): loss.item()"


def rank(
    phase: str = "train batch 60",
    idle: float = 4.0,
    *,
    deadline: float | None = 30.0,
    ceiling: float | None = 600.0,
    at: str | None = None,
    blocked: str | None = None,
    frame: str | None = "train.py:88 (train)",
    wait: float = 4.0,
    settled: bool = True,
    progress: int = 100,
    quiet: bool = True,
    record: tuple[GroupRecord, ...] = (),
    thread: str = "MainThread",
    **kw,
) -> RankStatus:
    """One rank's status: in its own code unless ``at`` names the rendezvous it waits at."""
    return RankStatus(
        phase=phase,
        step=60,
        idle_s=idle,
        deadline_s=deadline,
        ceiling_s=ceiling,
        host="node",
        pid=1,
        blocked_in=blocked or (at if at and at != LEFT_LOOP else None),
        user_frame=frame,
        waits_at=at,
        wait_s=wait if at else 0.0,
        settled=settled and at is not None,
        progress=progress,
        quiet=quiet,
        record=record,
        loop_thread=thread,
        **kw,
    )


def issued(seq, op="all_reduce", numel=1, where="train.py:88 (log): dist.all_reduce(t)", **kw):
    kw.setdefault("thread", "MainThread")
    dtype, t = kw.pop("dtype", "float32"), kw.pop("t", 100.0 + seq)
    return Issued(seq, op, dtype, numel, where, kw["thread"], t, kw.get("origin"), kw.get("phase"))


#: What DDP issues, as the record tells it (collective_infer, collective_sources).
BUCKET0 = "gradient bucket 0 of {at}'s backward (DDP)"
BUFFERS = "module buffers in {at}'s forward (DDP's broadcast_buffers)"
FORWARD_LINE = "train.py:40 (main): loss = model(x).sum()"


def bucket(seq: int, step: int, numel: int = 25_000_000, **kw) -> Issued:
    """DDP's all-reduce of gradient bucket 0, issued from C++ after a forward (no line)."""
    return issued(seq, numel=numel, where=None, origin=BUCKET0, phase=f"train batch {step}", **kw)


def buffers(seq: int, step: int, numel: int = 64) -> Issued:
    """DDP's broadcast of module buffers before a forward."""
    where = FORWARD_LINE
    return issued(seq, "broadcast", numel, where, origin=BUFFERS, phase=f"train batch {step}")


def fsdp_gather(seq: int, module: str, direction: str, step: int) -> Issued:
    """FSDP2's all-gather of a module's parameters, under its forward or backward hook."""
    origin = f"FSDP's all-gather of the parameters of module {module!r} for {{at}}'s {direction}"
    line = "train.py:41 (main): loss.backward()" if direction == "backward" else FORWARD_LINE
    return issued(
        seq, "all_gather_into_tensor", 136, line, origin=origin, phase=f"train batch {step}"
    )


def group(name: str, count: int, *calls: Issued) -> GroupRecord:
    return GroupRecord(name, (0, 1), count, calls or (issued(count),))


def left(step: int = 83, stop: str | None = "should_stop") -> RankStatus:
    """A rank whose fit ended, as its watchdog sends it: settled at once, no deadline."""
    decisions = ((stop, True, step),) if stop else ()
    return dataclasses.replace(
        rank(f"{LEFT_LOOP} at step {step}", deadline=None, ceiling=None, at=LEFT_LOOP),
        blocked_in=None,
        decisions=decisions,
    )


def judge(statuses: dict[int, RankStatus]) -> Verdict:
    """Two exchanges a second apart with the same statuses: what the watchdog acts on."""
    first = diagnose(statuses, split_decisions=WORDS)
    return diagnose(statuses, incident=first.stuck, suspect=first.suspect, split_decisions=WORDS)


#: What each adapter announces of a batch: the loop (Lightning, Composer alike) and the HF Trainer.
LOOP = (BACKWARD, BACKWARD_END, OPTIMIZER_STEP)
TRAINER = (MICROBATCH, BACKWARD_OPTIMIZER_STEP)
#: One train batch of a loop that steps its optimizer after each backward.
STEP = ("batch", BACKWARD, BACKWARD_END, OPTIMIZER_STEP, "end")


def ran(*events: str, announces: tuple[str, ...] = LOOP) -> Phases:
    """A rank's history, read by the watchdog's reader from the step log's entries.

    ``"batch"`` starts the next train batch (steps from 0), ``"end"`` ends it; other
    names are step-log events (``"epoch_end"``, ``"fit_end"``, a batch's parts).
    """
    history, step, entries = History(), 0, []
    history.announces = announces
    for event in ("fit_start", "epoch_start", *events):
        if event == "batch":
            entries.append((0.0, FETCH_END_BATCH_START, step, None, None, None))
        elif event == "end":
            step += 1
            entries.append((0.0, BATCH_END_FETCH_START, step - 1, step, None, None))
        else:
            entries.append((0.0, event, step, None, None, None))
    history.read(entries)
    return history.phases()


BACKWARD_AT = "train.py:337 (main): loss.backward()"
FORWARD_AT = "train.py:328 (main): loss = model(**batch).loss"


def _skipped_backward():
    """The issue: rank 1's loss is not finite in batch 5 and it does `continue`: rank 0 waits in
    batch 5's backward (DDP's gradient all-reduce), rank 1 in batch 6's forward (the buffer
    broadcast)."""
    return {
        0: rank("train batch 5", at="backward", frame=BACKWARD_AT, usual=True,
                phases=ran(*STEP * 5, "batch", BACKWARD)),
        1: rank("train batch 6", at="broadcast", frame=FORWARD_AT, usual=True,
                phases=ran(*STEP * 5, "batch", "end", "batch")),
    }  # fmt: skip


def _uneven_windows():
    """Windows of 2 backward passes on rank 0, 3 on rank 1 (a token budget per rank): rank 0's
    second backward all-reduces, rank 1's runs under `no_sync()` and its third forward
    broadcasts the buffers."""
    no_step = ("batch", BACKWARD, BACKWARD_END, "end")
    return {
        0: rank("train batch 1", at="backward", frame=BACKWARD_AT,
                phases=ran(*no_step, "batch", BACKWARD)),
        1: rank("train batch 2", at="broadcast", frame=FORWARD_AT,
                phases=ran(*no_step * 2, "batch")),
    }  # fmt: skip


def _uneven_last_window():
    """The HF Trainer, 4 microbatches a step: rank 1's pass has 5, rank 0's 6. Rank 1's fifth
    ends its last window (the all-reduce); rank 0's fifth does not, its sixth forward
    broadcasts the buffers."""
    window = (MICROBATCH, MICROBATCH, MICROBATCH, BACKWARD_OPTIMIZER_STEP)
    return {
        0: rank("train batch 1", at="broadcast", frame="trainer.py:9 (main): trainer.train()",
                phases=ran("batch", *window, "end", "batch", MICROBATCH, announces=TRAINER)),
        1: rank("train batch 1", at="backward", frame="trainer.py:9 (main): trainer.train()",
                phases=ran("batch", *window, "end", "batch", announces=TRAINER)),
    }  # fmt: skip


def _uneven_pass(rank0: RankStatus):
    """Rank 0's shard ends after 5 batches; rank 1 waits in its sixth batch's backward."""
    return {
        0: rank0,
        1: rank("train batch 5", at="backward", frame=BACKWARD_AT, usual=True,
                phases=ran(*STEP * 5, "batch", BACKWARD)),
    }  # fmt: skip


def _pass_ended() -> RankStatus:
    """Rank 0 after its pass's 5 batches, in the batch-parity check at its end."""
    return rank("epoch end", at="rankguard exchange", blocked=EXCHANGE, usual=True,
                phases=ran(*STEP * 5, "epoch_end"))  # fmt: skip


def _eval_on_rank0():
    """Rank 0 alone evaluates after batch 8 (its all_reduce); rank 1 waits in batch 9's backward."""
    return {
        0: rank("eval batch 0 of 'eval'", at="all_reduce", direct=True,
                frame="train.py:95 (main): dist.all_reduce(eval_loss)",
                phases=ran(*STEP * 8, "eval_start")),
        1: rank("train batch 8", at="backward", frame=BACKWARD_AT, usual=True,
                phases=ran(*STEP * 8, "batch", BACKWARD)),
    }  # fmt: skip


#: ``dcp.async_save``'s thread (torch 2.13's name; 2.7's is ``ThreadPoolExecutor-0_0``).
SAVER = "AsyncCheckpointExecutor_0"


def barrier(seq: int) -> Issued:
    return issued(seq, "barrier", 0, "train.py:60 (main): dist.barrier()", dtype="-")


def save_gather(seq: int) -> Issued:
    return issued(seq, "gather_object", 0, None, thread=SAVER, dtype="-")


# -- the cases ---------------------------------------------------------------------------------
#: The background thread of OLMo-core 3.0's asynchronous save: its done-callback reduces a metric.
ASYNC_SAVE = issued(
    17,
    numel=0,
    where="utils.py:314 (reduce_metrics): dist.all_reduce(",
    thread="AsyncCheckpointExecutor_0",
)


def _stalled_rank_with_a_background_reduction():
    """The field failure: rank 1 sleeps in its post_step hook, its save thread reduced a metric."""
    return {
        0: rank("after eval of 'eval'", 35, at="rankguard exchange", blocked=EXCHANGE,
                record=(group("0", 60), group("14", 16))),
        1: rank("after eval of 'eval'", 35, frame="job.py:250 (post_step): time.sleep(3600)",
                record=(group("0", 60), group("14", 17, ASYNC_SAVE))),
    }  # fmt: skip


def _nccl_item_behind_an_async_collective():
    """NCCL: rank 0's training thread issued an async all_reduce rank 1 never issues, then
    blocks at ``loss.item()``; rank 1 issued its next gradient all-reduce and blocks at its own."""
    extra = issued(13, where="train.py:88 (log): dist.all_reduce(t, async_op=True)")
    grad = issued(6, numel=4, where="train.py:120 (step): dist.all_reduce(grad)")
    grad = grad._replace(t=201.0)
    return {
        0: rank(frame=ITEM, record=(group("0", 5), group("1", 13, extra))),
        1: rank(frame=ITEM, record=(group("0", 6, grad), group("1", 12))),
    }  # fmt: skip


CASES: list[tuple[str, Callable[[], dict[int, RankStatus]], dict]] = [
    # -- healthy: nothing to say -------------------------------------------------------------
    (
        "healthy: both training",
        lambda: {0: rank(idle=0.1, quiet=False), 1: rank(idle=0.1, quiet=False)},
        dict(kind="healthy", stuck=(), exit=None, summary=""),
    ),
    (
        "healthy: every rank left the loop (a normal end)",
        lambda: {0: left(stop=None), 1: left(84, None)},
        dict(kind="healthy", stuck=(), exit=None, summary=""),
    ),
    (
        "healthy: every rank long in the same collective (a large all_reduce)",
        lambda: {r: rank(at="all_reduce", frame="train.py:120 (step)") for r in (0, 1)},
        dict(kind="healthy", stuck=(), exit=None, summary=""),
    ),
    (
        "healthy: rank 1 10 s behind in a checkpoint write, rank 0 issued one more and waits",
        lambda: {
            0: rank(frame="train.py:90 (log): work.wait()", record=(group("0", 41),)),
            1: rank(
                "checkpoint save at step 60",
                10,
                frame="ckpt.py:12 (write)",
                record=(group("0", 40),),
            ),
        },
        dict(kind="healthy", stuck=(), exit=None, summary=""),
    ),
    (
        "healthy: rank-0-only logging while rank 1 waits in the next all_reduce",
        lambda: {
            0: rank(frame="train.py:70 (log_on_rank0)", record=(group("0", 40),)),
            1: rank(at="all_reduce", frame="train.py:120 (step)", record=(group("0", 41),)),
        },
        dict(kind="healthy", stuck=(), exit=None, summary=""),
    ),
    (
        "healthy: FSDP prefetch, counts differ while the ranks still issue",
        lambda: {
            0: rank(quiet=False, record=(group("0", 44),)),
            1: rank(quiet=False, record=(group("0", 41),)),
        },
        dict(kind="healthy", stuck=(), exit=None, summary=""),
    ),
    (
        "healthy: ranks wait at different rendezvous for less than their settle time",
        lambda: {
            0: rank(at="all_reduce", settled=False),
            1: rank(at="barrier", settled=False, frame="b.py:1 (f)"),
        },
        dict(kind="healthy", stuck=(), exit=None, summary=""),
    ),
    # -- slow and stalled: a rank in its own code past its deadline ---------------------------
    (
        "post-eval stall: rank 1 in a hook after eval, rank 0 in the epoch-start check",
        lambda: {
            0: rank("epoch start at step 60", 34, at="rankguard exchange", blocked=EXCHANGE),
            1: rank("after eval of 'eval'", 34, frame="hooks.py:9 (on_eval_end): time.sleep(3600)"),
        },
        dict(
            kind="slow",
            stuck=((1, 1),),
            first=1,
            exit=None,
            summary="rank 1 stuck 34 s in after eval of 'eval' (deadline 30 s, calibrated; "
            "ceiling 600 s); "
            "rank 0 waiting 34 s in epoch start at step 60 (blocked in rankguard exchange",
        ),
    ),
    (
        "post-eval stall at the ceiling: the incident ends, restart",
        lambda: {
            0: rank("epoch start at step 60", 601, at="rankguard exchange", blocked=EXCHANGE),
            1: rank("after eval of 'eval'", 601),
        },
        dict(
            kind="stall",
            stuck=((1, 1),),
            first=1,
            exit=75,
            summary="rank 1 stuck 601 s in after eval",
        ),
    ),
    (
        "mid-eval stall: rank 1 inside eval batch 2, rank 0 in the metric all_reduce",
        lambda: {
            0: rank(
                "after eval batch 3 of 'eval'", 31, at="all_reduce", frame="metrics.py:5 (sync)"
            ),
            1: rank("eval batch 2 of 'eval'", 31),
        },
        dict(
            kind="slow",
            stuck=((1, 1),),
            first=1,
            exit=None,
            summary="rank 1 stuck 31 s in eval batch 2 of 'eval'",
        ),
    ),
    (
        "train-step stall: rank 1 inside its step, rank 0 in DDP's gradient all-reduce (backward)",
        lambda: {
            0: rank(
                "train batch 30", 31, at="backward", frame="train.py:60 (step): loss.backward()"
            ),
            1: rank("train batch 30", 31, frame="train.py:58 (step): stall()"),
        },
        dict(
            kind="slow",
            stuck=((1, 1),),
            first=1,
            exit=None,
            summary="rank 1 stuck 31 s in train batch 30",
        ),
    ),
    (
        "a stalled rank whose background thread issued a reduction: a stall, not a desync (75)",
        _stalled_rank_with_a_background_reduction,
        dict(
            kind="slow",
            stuck=((1, 1),),
            first=1,
            exit=None,
            summary="rank 1 stuck 35 s in after eval of 'eval'",
            details="rank 1: all_reduce float32[0] at utils.py:314 (reduce_metrics): "
            "dist.all_reduce(, "
            "thread AsyncCheckpointExecutor_0",
        ),
    ),
    (
        "the same at the ceiling: exit 75, restart",
        lambda: {
            r: dataclasses.replace(s, idle_s=601.0)
            for r, s in _stalled_rank_with_a_background_reduction().items()
        },
        dict(
            kind="stall",
            stuck=((1, 1),),
            first=1,
            exit=75,
            summary="rank 1 stuck 601 s in after eval",
        ),
    ),
    (
        "a check gave up waiting for rank 1: the incident ends at once",
        lambda: {
            0: rank(
                at="rankguard exchange",
                blocked=EXCHANGE,
                gave_up=("batch_parity/eval_end", (1,), 300.0),
            ),
            1: rank("after eval of 'eval'", 20),
        },
        dict(
            kind="stall",
            stuck=((1, 1),),
            first=1,
            exit=75,
            summary="rank 1 stuck 20 s in after eval of 'eval'",
            details="rank 1 did not reach rankguard exchange 'batch_parity/eval_end' within 300 s",
        ),
    ),
    # -- deadlocks proven from where every rank waits ----------------------------------------
    (
        "unmatched collective: rank 1's own all_reduce, rank 0 in the epoch-start check",
        lambda: {
            0: rank(
                at="rankguard exchange", blocked=EXCHANGE, frame="train.py:146 (fit): trainer.fit()"
            ),
            1: rank(
                at="all_reduce", frame="cb.py:84 (on_eval_end): dist.all_reduce(t)", direct=True
            ),
        },
        dict(
            kind="deadlock",
            stuck=((0, 1),),
            first=1,
            exit=70,
            summary="deadlock, every rank waits at a rendezvous the others never reach: ",
            details="Next: fix the code path at rank 1's wait point (all_reduce at cb.py:84",
        ),
    ),
    (
        "a collective under `if rank == 0`: rank 0's, rank 1 in the data fetch's all_reduce",
        lambda: {
            0: rank(
                at="all_reduce",
                frame="train.py:105 (reduce_on_rank0_only): dist.all_reduce(t)",
                direct=True,
            ),
            1: rank(at="all_reduce", frame="train.py:146 (fit): trainer.fit()"),
        },
        dict(
            kind="deadlock",
            stuck=((0, 1),),
            first=0,
            exit=70,
            summary="deadlock, every rank waits at a rendezvous the others never reach: ",
        ),
    ),
    (
        "should_stop set on rank 0 alone: it left the loop, rank 1 waits in the buffer broadcast",
        lambda: {
            0: left(),
            1: rank(
                at="broadcast", frame="job.py:726 (main)", decisions=(("should_stop", False, 0),)
            ),
        },
        dict(
            kind="deadlock",
            stuck=((0, 1),),
            first=0,
            exit=70,
            summary="deadlock, rank 0 left the training loop while the others wait at a "
            "rendezvous in it: ",
            details="What split them: rank 0 set should_stop at step 83; rank 1 did not.",
        ),
    ),
    (
        "the HF Trainer's early stop on rank 0: in the check at epoch end, rank 1 in broadcast",
        lambda: {
            0: rank(at="rankguard exchange", decisions=(("should_training_stop", True, 3),)),
            1: rank(
                at="broadcast",
                frame="t.py:9 (main)",
                decisions=(("should_training_stop", False, 0),),
            ),
        },
        dict(
            kind="deadlock",
            stuck=((0, 1),),
            first=0,
            exit=70,
            summary="deadlock, every rank waits at a rendezvous the others never reach: ",
            details="Next: fix the stop decision of rank 0: it set should_training_stop at step 3",
        ),
    ),
    (
        "a key logged with sync_dist=True on rank 1 only: rank 0 in backward, rank 1 in all_gather",
        lambda: {
            0: rank(
                at="backward",
                frame="model.py:150 (training_step)",
                usual=True,
                decisions=(("sync_dist_keys", ("loss",), 8), ("sync_dist_loop", "train", 8)),
            ),
            1: rank(
                at="all_gather",
                frame="model.py:152 (training_step): self.log(...)",
                decisions=(
                    ("sync_dist_keys", ("extra", "loss"), 8),
                    ("sync_dist_loop", "train", 8),
                ),
            ),
        },
        dict(
            kind="deadlock",
            stuck=((0, 1),),
            first=1,
            exit=70,
            summary="deadlock, every rank waits at a rendezvous the others never reach: ",
            details="What split them: rank 0 logged with sync_dist=True at step 60: loss; "
            "rank 1 logged with sync_dist=True at step 60: extra, loss.",
        ),
    ),
    (
        "a save entered on rank 1 only: its barrier, rank 0 in the next gradient all-reduce",
        lambda: {
            0: rank(at="backward", frame="train.py:60 (step)", usual=True),
            1: rank(
                at="barrier",
                frame="ckpt.py:30 (save): dist.barrier()",
                decisions=(("save", True, 80),),
            ),
        },
        dict(
            kind="deadlock",
            stuck=((0, 1),),
            first=1,
            exit=70,
            summary="deadlock, every rank waits at a rendezvous the others never reach: ",
            details="What split them: rank 1 entered a checkpoint save at step 80; rank 0 did not.",
        ),
    ),
    # -- what split them, from each rank's history ------------------------------------------
    (
        "a backward skipped on rank 1 (`continue` on a non-finite loss): the skip, not the wait",
        _skipped_backward,
        dict(
            kind="deadlock",
            stuck=((0, 1),),
            first=1,
            exit=70,
            summary="deadlock, rank 1 ran no backward for train batch 5 (it waits in train batch "
            "6's forward; rank 0 waits in train batch 5's backward)",
            details="Next: decide a skip on every rank together: rank 1 left a batch without its "
            "backward",
        ),
    ),
    (
        "4 ranks, 1 and 3 skip the backward: their group is named, the others' wait after it",
        lambda: {r: dataclasses.replace(_skipped_backward()[r % 2], pid=r) for r in range(4)},
        dict(
            kind="deadlock",
            stuck=((0, 3),),
            first=1,
            exit=70,
            summary="deadlock, ranks 1,3 ran no backward for train batch 5 (they wait in train "
            "batch 6's forward; ranks 0,2 wait in train batch 5's backward)",
        ),
    ),
    (
        "accumulation windows of 2 and 3 backward passes: rank 0's second all-reduces",
        _uneven_windows,
        dict(
            kind="deadlock",
            stuck=((0, 1),),
            first=0,
            exit=70,
            summary="deadlock, the ranks' accumulation windows differ: rank 0 ends one after 2 "
            "backward passes, in train batch 1, and waits there in its gradient all-reduce; "
            "rank 1 does not, its window goes on past 2 (it waits in train batch 2's forward)",
            details="Next: keep the accumulation windows equal on every rank",
        ),
    ),
    (
        "the HF Trainer's uneven last window: rank 1's fifth microbatch ends it, rank 0's not",
        _uneven_last_window,
        dict(
            kind="deadlock",
            stuck=((0, 1),),
            first=1,
            exit=70,
            summary="deadlock, the ranks' accumulation windows differ: rank 1 ends one after 1 "
            "backward pass, in train batch 1, and waits there in its gradient all-reduce; rank 0 "
            "does not, its window goes on past 1 (it waits in train batch 1's forward)",
        ),
    ),
    (
        "an uneven pass: rank 0's ended after 5 batches, in the batch-parity check at its end",
        lambda: _uneven_pass(_pass_ended()),
        dict(
            kind="deadlock",
            stuck=((0, 1),),
            first=0,
            exit=70,
            summary="deadlock, rank 0's pass over the train loader ended after 5 batches (train "
            "batch 4 its last); rank 1 went on to train batch 5 in its pass (it waits in train "
            "batch 5's backward; rank 0 waits at the end of its pass)",
            details="Next: give every rank the same number of batches per pass: rank 0's pass "
            "ended first",
        ),
    ),
    (
        "an uneven pass where rank 0's fit then ended: its pass, not a stop decision",
        lambda: _uneven_pass(
            dataclasses.replace(left(5, None), phases=ran(*STEP * 5, "epoch_end", "fit_end"))
        ),
        dict(
            kind="deadlock",
            stuck=((0, 1),),
            first=0,
            exit=70,
            summary="deadlock, rank 0's pass over the train loader ended after 5 batches",
            details="Where they wait: rank 0 left the training loop while the others wait",
        ),
    ),
    (
        "should_stop on rank 0 with both histories: the stop decision is the cause",
        lambda: {
            0: dataclasses.replace(left(5), phases=ran(*STEP * 5, "fit_end")),
            1: rank(at="broadcast", frame="job.py:726 (main)", phases=ran(*STEP * 5, "batch")),
        },
        dict(
            kind="deadlock",
            stuck=((0, 1),),
            first=0,
            exit=70,
            summary="deadlock, rank 0 left the training loop while the others wait",
            details="Next: fix the stop decision of rank 0",
        ),
    ),
    (
        "an eval on rank 0 only, first: no words of the history, the wait point's",
        _eval_on_rank0,
        dict(
            kind="deadlock",
            stuck=((0, 1),),
            first=0,
            exit=70,
            summary="deadlock, every rank waits at a rendezvous the others never reach: ",
            details="Next: fix the code path at rank 0's wait point (all_reduce at train.py:95",
        ),
    ),
    (
        "healthy: rank 1 a batch behind, its backward still to come",
        lambda: {
            0: rank(idle=0.2, quiet=False, phases=ran(*STEP * 6)),
            1: rank(idle=0.2, quiet=False, phases=ran(*STEP * 5, "batch")),
        },
        dict(kind="healthy", stuck=(), exit=None, summary=""),
    ),
    # -- desyncs proven from what every rank issued ------------------------------------------
    (
        "async metric reductions, one more on rank 0: it waits in work.wait(), rank 1 all_reduce",
        lambda: {
            0: rank(
                frame="test.py:70 (wait_for): work.wait()", record=(group("0", 40), group("1", 11))
            ),
            1: rank(
                at="all_reduce", frame="test.py:80 (job)", record=(group("0", 41), group("1", 10))
            ),
        },
        dict(
            kind="desync",
            stuck=((0, 1),),
            first=0,
            exit=70,
            summary="desync, every rank waits for a collective another never issued: rank 0 issued "
            "collective #11 of group 1 (ranks 0,1), all_reduce float32[1] at train.py:88 (log)",
        ),
    ),
    (
        "NCCL: a rank blocked at .item() behind an async collective its own thread issued",
        _nccl_item_behind_an_async_collective,
        dict(
            kind="desync",
            stuck=((0, 1),),
            first=0,
            exit=70,
            summary="desync, every rank waits for a collective another never issued: rank 0 issued "
            "collective #13 of group 1 (ranks 0,1)",
        ),
    ),
    (
        "FSDP2: rank 1's extra forward all-gathers, rank 0 in the epoch-start check",
        lambda: {
            0: rank(at="rankguard exchange", blocked=EXCHANGE, record=(group("0", 200),)),
            1: rank(
                frame="job.py:40 (debug_forward): model(x)",
                record=(
                    group(
                        "0",
                        202,
                        issued(201, "all_gather_single", 64),
                        issued(202, "all_gather_single", 64),
                    ),
                ),
            ),
        },
        dict(
            kind="desync",
            stuck=((0, 1),),
            first=1,
            exit=70,
            summary="desync, every rank waits for a collective another never issued: rank 1 issued "
            "collective #201 of the default group (ranks 0,1), all_gather_single float32[64]",
        ),
    ),
    (
        "ranks paired unlike calls at one count, both their last: a desync",
        lambda: {
            0: rank(record=(group("0", 7, issued(7, numel=4)),)),
            1: rank(record=(group("0", 7, issued(7)),)),
        },
        dict(
            kind="desync",
            stuck=((0, 1),),
            exit=70,
            summary="desync, every rank waits for a collective another never issued: "
            "collective #7 of "
            "the default group (ranks 0,1) is a different call on different ranks",
        ),
    ),
    # -- what DDP and FSDP issue, told: the calls, not only their numbers ----------------------
    (
        "DDP: rank 1 skipped a backward: its buffer broadcast met rank 0's gradient bucket",
        lambda: {
            0: rank(
                at="backward",
                frame="train.py:41 (main): loss.backward()",
                record=(group("0", 18, buffers(17, 5), bucket(18, 5)),),
            ),
            1: rank(
                at="broadcast",
                frame=FORWARD_LINE,
                record=(group("0", 19, buffers(17, 5), buffers(18, 6), buffers(19, 6)),),
            ),
        },
        dict(
            kind="desync",
            stuck=((0, 1),),
            first=1,
            exit=70,
            summary="desync, every rank waits for a collective another never issued: collective "
            "#18 of the default group (ranks 0,1) is a different call on different ranks: rank 0: "
            "all_reduce float32[25,000,000], gradient bucket 0 of train batch 5's backward (DDP); "
            "rank 1: broadcast float32[64], module buffers in train batch 6's forward (DDP's "
            "broadcast_buffers)",
            details="Next: rank 1 issued module buffers in train batch 6's forward (DDP's "
            "broadcast_buffers) where rank 0 issued gradient bucket 0 of train batch 5's "
            "backward (DDP)",
        ),
    ),
    (
        "DDP at one count, 64 floats against a 24M-float bucket, both their last (ms-swift)",
        lambda: {
            0: rank(record=(group("0", 30, bucket(30, 9, 24_000_000)),)),
            1: rank(record=(group("0", 30, buffers(30, 10)),)),
        },
        dict(
            kind="desync",
            stuck=((0, 1),),
            first=1,
            exit=70,
            summary="desync, every rank waits for a collective another never issued: collective "
            "#30 of the default group (ranks 0,1) is a different call on different ranks: rank 0: "
            "all_reduce float32[24,000,000], gradient bucket 0 of train batch 9's backward",
        ),
    ),
    (
        "FSDP2: rank 1 ran a forward more: all-gathers of another layer, the same size",
        lambda: {
            0: rank(
                record=(
                    group(
                        "0",
                        22,
                        fsdp_gather(21, "2", "backward", 3),
                        fsdp_gather(22, "1", "backward", 3),
                    ),
                )
            ),
            1: rank(
                record=(
                    group(
                        "0",
                        22,
                        fsdp_gather(21, "0", "forward", 3),
                        fsdp_gather(22, "1", "forward", 3),
                    ),
                )
            ),
        },
        dict(
            kind="desync",
            stuck=((0, 1),),
            first=1,
            exit=70,
            summary="desync, every rank waits for a collective another never issued: collective "
            "#21 of the default group (ranks 0,1) is a different call on different ranks: rank 0: "
            "all_gather_into_tensor float32[136], FSDP's all-gather of the parameters of module "
            "'2' for train batch 3's backward; rank 1: all_gather_into_tensor float32[136], "
            "FSDP's all-gather of the parameters of module '0' for train batch 3's forward",
        ),
    ),
    (
        "Lightning: a key synced on rank 1 only meets DDP's bucket: the stacks name the log call",
        lambda: {
            0: rank(
                at="backward",
                frame="train.py:41 (main): trainer.fit(model)",
                record=(group("0", 35, bucket(35, 5, 5)),),
            ),
            1: rank(
                at="barrier",
                frame="model.py:62 (training_step): self.log(..., sync_dist=True)",
                direct=True,
                record=(
                    group(
                        "0",
                        35,
                        issued(
                            35,
                            "barrier",
                            0,
                            "model.py:62 (training_step): self.log(...)",
                            dtype="-",
                        ),
                    ),
                ),
            ),
        },
        dict(
            kind="deadlock",
            stuck=((0, 1),),
            first=1,
            exit=70,
            summary="deadlock, every rank waits at a rendezvous the others never reach: ",
            details="rank 0: all_reduce float32[5], gradient bucket 0 of train batch 5's backward",
        ),
    ),
    (
        "DDP's buckets, rank 1 still in its forward's own code: a slow rank, never a desync",
        lambda: {
            0: rank(at="backward", record=(group("0", 18, buffers(17, 5), bucket(18, 5)),)),
            1: rank(
                "train batch 60",
                35,
                frame="model.py:12 (forward): slow_op(x)",
                record=(group("0", 17, buffers(17, 5)),),
            ),
        },
        dict(kind="slow", stuck=((1, 1),), first=1, exit=None, summary="rank 1 stuck 35 s"),
    ),
    (
        "DDP's backward from autograd's thread against the training thread's broadcast: a desync",
        lambda: {
            0: rank(at="backward", record=(group("0", 18, bucket(18, 5, thread="Dummy-1")),)),
            1: rank(at="broadcast", frame=FORWARD_LINE, record=(group("0", 18, buffers(18, 6)),)),
        },
        dict(kind="desync", stuck=((0, 1),), first=1, exit=70, summary="desync, every rank"),
    ),
    # -- two threads on one process group ----------------------------------------------------
    (
        "dcp.async_save's thread and the training thread's barrier on one group (back to back)",
        lambda: {
            0: rank(
                at="barrier",
                frame="train.py:60 (main): dist.barrier()",
                record=(
                    group(
                        "0",
                        3,
                        issued(2, "barrier", 0, "train.py:60 (main): dist.barrier()"),
                        issued(3, "gather_object", 0, None, thread=SAVER),
                    ),
                ),
            ),
            1: rank(
                at="barrier",
                frame="train.py:60 (main): dist.barrier()",
                record=(
                    group(
                        "0",
                        3,
                        issued(2, "gather_object", 0, None, thread=SAVER),
                        issued(3, "barrier", 0, "train.py:60 (main): dist.barrier()"),
                    ),
                ),
            ),
        },
        dict(
            kind="race",
            stuck=((0, 1),),
            first=1,
            exit=70,
            summary="two threads issued collectives on the default group (ranks 0,1) in a "
            "different order on different ranks: threads MainThread, AsyncCheckpointExecutor_0; "
            "collective #2: rank 0: barrier at train.py:60",
            details="Next: one thread per process group. Give the background work its own group",
        ),
    ),
    (
        "torch 2.7: the save's thread and the training thread took one number at once",
        lambda: {
            0: rank(at="barrier", record=(group("0", 6, barrier(5), save_gather(5)),)),
            1: rank(at="barrier", record=(group("0", 6, save_gather(5), barrier(6)),)),
        },
        dict(
            kind="race",
            stuck=((0, 1),),
            first=0,
            exit=70,
            summary="two threads issued collectives on the default group (ranks 0,1) in a "
            "different order on different ranks: threads MainThread, AsyncCheckpointExecutor_0; "
            "collective #5: rank 0: barrier at train.py:60 (main): dist.barrier(), thread "
            "MainThread and gather_object, thread AsyncCheckpointExecutor_0; rank 1: "
            "gather_object, thread AsyncCheckpointExecutor_0",
        ),
    ),
    (
        "one number twice from two threads, every rank computing in its own code: healthy",
        lambda: {r: rank(record=(group("0", 6, barrier(5), save_gather(5)),)) for r in (0, 1)},
        dict(kind="healthy", stuck=(), exit=None, summary=""),
    ),
    (
        "two threads on one group, in the same order on every rank: healthy",
        lambda: {
            r: rank(
                quiet=False,
                record=(
                    group(
                        "0", 3, issued(2, "barrier", 0), issued(3, "gather_object", 0, thread=SAVER)
                    ),
                ),
            )
            for r in (0, 1)
        },
        dict(kind="healthy", stuck=(), exit=None, summary=""),
    ),
    (
        "a background save on a group of its own, one rank's save thread ahead: healthy",
        lambda: {
            0: rank(quiet=False, record=(group("0", 40), group("7", 2, issued(2, thread=SAVER)))),
            1: rank(
                quiet=False,
                record=(
                    group("0", 40),
                    group("7", 3, issued(2, thread=SAVER), issued(3, thread=SAVER)),
                ),
            ),
        },
        dict(kind="healthy", stuck=(), exit=None, summary=""),
    ),
    (
        "unlike calls while the job still runs: healthy, with the mismatch told",
        lambda: {
            r: rank(
                quiet=False,
                record=(group("0", 9, issued(7, numel=4 - 3 * r), issued(8), issued(9)),),
            )
            for r in (0, 1)
        },
        dict(kind="healthy", stuck=(), exit=None, summary="", mismatch="collective #7"),
    ),
]


@pytest.mark.parametrize("name, statuses, expected", CASES, ids=[c[0] for c in CASES])
def test_each_case_has_one_verdict(name, statuses, expected):
    verdict = judge(statuses())
    assert verdict.kind == expected["kind"], verdict
    assert verdict.stuck == expected["stuck"], verdict
    if "first" in expected:
        assert verdict.first == expected["first"], verdict
    assert verdict.exit_code == expected["exit"]
    assert verdict.summary.startswith(expected["summary"]), verdict.summary
    if "details" in expected:
        assert any(expected["details"] in line for line in verdict.details), verdict.details
    if verdict.kind in ("deadlock", "desync", "race"):
        assert "exit code 70, do not restart" in "\n".join(verdict.details)
    if "mismatch" in expected:
        assert verdict.mismatch is not None and expected["mismatch"] in verdict.mismatch[1]


def test_a_proof_seen_once_is_a_suspicion_and_progress_in_between_undoes_it():
    statuses = {0: rank(at="all_reduce", direct=True), 1: rank(at="barrier", frame="b.py:1 (f)")}
    once = diagnose(statuses, split_decisions=WORDS)
    assert once.kind == "healthy" and once.suspect is not None
    moved = {**statuses, 1: dataclasses.replace(statuses[1], progress=101)}
    assert diagnose(moved, suspect=once.suspect, split_decisions=WORDS).kind == "healthy"


def test_a_silent_rank_is_gone_after_the_slack_and_at_once_where_a_check_gave_up():
    last = diagnose({0: rank(idle=1.0, quiet=False), 1: rank(idle=1.0, quiet=False)})
    assert last.slack_s == 29.0
    assert gone([1], rank=0, waited_s=20, last=last, default_s=1800) is None  # briefly busy
    frozen = gone([1], rank=0, waited_s=31, last=last, default_s=1800)
    assert (frozen.kind, frozen.stuck, frozen.end, frozen.exit_code) == (
        "gone",
        ((1, 1),),
        False,
        75,
    )
    assert frozen.summary.startswith(
        "rank 1 frozen or dead (no answer on the side channel for 31 s"
    )
    assert frozen.details[0].startswith("Next: on the host of rank 1, look for an OOM kill")
    dead = gone([1], rank=0, waited_s=5, last=last, default_s=1800, given_up=[1])
    assert (dead.kind, dead.end) == ("gone", True)
    assert gone([1], rank=0, waited_s=700, last=last, default_s=1800).end  # past every ceiling


def test_a_rank_heard_before_is_named_when_its_thread_goes_silent_whatever_its_phase():
    # Heard in start-up, whose deadline is 30 min: rank 1 froze inside its first step.
    startup = diagnose(
        {r: rank("start-up", idle=1.0, deadline=1800.0, ceiling=1800.0) for r in (0, 1)}
    )
    assert startup.slack_s > 1000
    silent = liveness(exchange_period_s=10.0, exchange_timeout_s=10.0)
    assert silent == (30.0, 70.0)
    kw = {"rank": 0, "last": startup, "default_s": 1800, "silent": silent}
    assert gone([1], waited_s=20, **kw) is None  # one missed exchange: a busy Python
    named = gone([1], waited_s=30, **kw)
    assert (named.kind, named.stuck, named.end, named.exit_code) == ("gone", ((1, 1),), False, 75)
    assert named.summary.startswith("rank 1 frozen or dead (no answer on the side channel for 30")
    assert "one call that holds the interpreter" in named.details[0]
    assert gone([1], waited_s=70, **kw).end  # six missed exchanges: the job ends
    assert gone([1], waited_s=69, **{**kw, "last": None}, heard=()) is None  # never heard
    early = gone([1], waited_s=30, **{**kw, "last": None}, heard=[1])  # its thread registered
    assert early.stuck == ((1, 1),) and "last seen: starting up" in early.summary
    done = diagnose({0: rank(), 1: rank(deadline=None, ceiling=None, at=LEFT_LOOP)})
    assert gone([1], waited_s=300, **{**kw, "last": done}) is None  # its fit ended: it closes


def test_a_status_built_well_before_the_stuck_ranks_is_asked_again_once_not_acted_on():
    # Rank 1 exchanged once more than rank 0: it sent its status 0.6 s after the last
    # verdict and froze; rank 0 joined that exchange 3 s after it, stalled 2.6 s (at its
    # next host sync, waiting for rank 1's collective). Rank 1 was running when rank 0's
    # stall began, and says nothing of itself since.
    early = rank(idle=0.1, quiet=False, since_verdict_s=0.6)
    late = rank(idle=2.6, deadline=1.0, ceiling=2.0, quiet=False, since_verdict_s=3.0)
    statuses = {0: late, 1: early}
    verdict = diagnose(statuses, split_decisions=WORDS)
    assert (verdict.kind, verdict.stuck, verdict.recheck) == ("stall", ((0, 0),), True)
    assert sent_apart(statuses, verdict.stuck) == [1]
    again = diagnose(statuses, split_decisions=WORDS, rechecked=True)  # acted on the second time
    assert (again.kind, again.stuck, again.recheck) == ("stall", ((0, 0),), False)
    # Built with rank 0's (0.4 s apart: two ranks' scheduling), rank 1's status clears it.
    together = {0: late, 1: dataclasses.replace(early, since_verdict_s=2.6)}
    assert not diagnose(together, split_decisions=WORDS).recheck
    # A first exchange (no verdict before it) and a healthy verdict are not compared.
    first = {r: dataclasses.replace(s, since_verdict_s=None) for r, s in statuses.items()}
    assert not diagnose(first, split_decisions=WORDS).recheck

    # A proof's first sighting on such statuses is not kept: the next exchange comes at once,
    # not a second later. Ranks 0 and 1 past the ceiling at unlike rendezvous, 2 sent early.
    def waits(status: RankStatus, at: str) -> RankStatus:
        return dataclasses.replace(status, waits_at=at, blocked_in=at, settled=True)

    unlike = {0: waits(late, "all_reduce"), 1: waits(late, "barrier"), 2: waits(early, "barrier")}
    seen = diagnose(unlike, split_decisions=WORDS, rechecked=True)
    assert seen.stuck == ((0, 1),) and seen.suspect is not None
    assert (diagnose(unlike, split_decisions=WORDS).recheck, seen.recheck) == (True, False)
    assert diagnose(unlike, split_decisions=WORDS).suspect is None
    calm = {0: dataclasses.replace(late, idle_s=0.1), 1: early}
    assert diagnose(calm, split_decisions=WORDS).kind == "healthy"
    assert not diagnose(calm, split_decisions=WORDS).recheck


def test_the_table_covers_every_verdict_class():
    kinds = {expected["kind"] for _, _, expected in CASES} | {"gone"}
    assert kinds == {"healthy", "slow", "stall", "gone", "deadlock", "desync", "race"}
