"""OLMo-core's asynchronous save and the metric it records per rank: the flush check.

OLMo-core's asynchronous save records ``checkpoint/save_async_duration_s``
(reduce type max, a Python float: float64) from the thread that completed it,
at the step that rank is in. Its first metric flush (step 1) compares the names
ever recorded; where they agree, each later reduction is sized by each rank's
own steps and names, so a metric flushed on one rank only pairs different
sizes. The pure parts first, then the flush's lock against that thread, then
one ``torchrun`` launch (``tests/e2e/olmo_core_async_job.py``) that fixes at
which step each rank's real pre-train save ends.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("olmo_core", reason="needs rankguard[olmo-core]")

import torch
from olmo_core.train.common import ReduceType

from rankguard.callbacks.hang.metric_reductions import Row, reduction_rows
from rankguard.integrations.olmo_core import flush as rg_olmo
from tests.mp import run_job

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
METRIC = "checkpoint/save_async_duration_s"
TYPES: dict[str, Any] = {
    "train/CE loss": ReduceType.mean,
    METRIC: ReduceType.max,
    "throughput/device/TPS": None,
    "stage/only_rank_1": ReduceType.sum,
}


def test_reduced_names_are_the_names_olmo_core_compares_at_its_first_flush():
    assert rg_olmo.reduced_names(TYPES) == (METRIC, "stage/only_rank_1", "train/CE loss")
    assert rg_olmo.reduced_names({}) == ()


def _flush(**steps: dict[str, Any]) -> dict[int, dict[str, torch.Tensor]]:
    """``_metrics`` as OLMo-core stores them: Python numbers float64, tensors float32."""
    return {
        int(step[1:]): {
            name: value.float() if isinstance(value, torch.Tensor) else torch.tensor(value).double()
            for name, value in values.items()
        }
        for step, values in steps.items()
    }


def test_a_gathered_flush_is_sized_by_its_steps_and_the_dtype_of_each_reduction():
    loss = {"train/CE loss": torch.tensor(2.0)}
    # The save's duration (a Python float) makes the max reduction float64.
    rows, compared = rg_olmo.gathered_flush(_flush(s0={METRIC: 0.3}, s1=loss), TYPES)
    assert rows == (Row(0, ((METRIC, "max"),)), Row(1, ()))
    assert compared == ((0, 1), ("max",))
    # A stage's own tensor metric changes neither: only its names differ, and they are gathered.
    stage = {**loss, "stage/only_rank_1": torch.tensor(1.0)}
    assert rg_olmo.gathered_flush(_flush(s0={}, s1=stage), TYPES)[1] == ((0, 1), ())
    assert rg_olmo.gathered_flush({}, TYPES) == ((), ((), ()))


class Recorded:
    """A ``ReductionCheck`` stand-in: what the flush compared, in order."""

    def __init__(self, same: bool = True) -> None:
        self.answer, self.calls = same, []

    def same(self, value: Any) -> bool:
        self.calls.append(("same", value))
        return self.answer

    def check(self, rows: Any, *, compared: Any = None) -> None:
        self.calls.append(("check", rows, compared))


def test_the_first_flush_compares_the_names_olmo_core_will_then_compare_the_rows():
    pending = _flush(s0={METRIC: 0.3}, s1={"train/CE loss": torch.tensor(2.0)})
    agreed = Recorded(same=True)
    rg_olmo.check_flush(agreed, pending, TYPES, None)  # type: ignore[arg-type]
    assert agreed.calls == [
        ("same", rg_olmo.reduced_names(TYPES)),
        ("check", reduction_rows(pending, TYPES), None),
    ]
    gathered = Recorded(same=False)  # OLMo-core will gather the names per flush
    rg_olmo.check_flush(gathered, pending, TYPES, None)  # type: ignore[arg-type]
    rows, compared = rg_olmo.gathered_flush(pending, TYPES)
    assert gathered.calls[1] == ("check", rows, compared)
    later = Recorded()  # OLMo-core's verdict is known: no names exchanged
    rg_olmo.check_flush(later, pending, TYPES, False)  # type: ignore[arg-type]
    assert [c[0] for c in later.calls] == ["check"]


class Trainer:
    """The part of OLMo-core's ``Trainer`` the flush hook reads, its flush as OLMo-core's."""

    def __init__(self) -> None:
        self.global_step = 1
        self._metrics: dict[int, dict[str, torch.Tensor]] = {}
        self._metrics_reduce_type: dict[str, Any] = {}
        self._metrics_consistent: bool | None = None
        self.flushed: list[dict[int, list[str]]] = []

    def record_metric(self, name: str, value: float, reduce_type: Any = None) -> None:
        self._metrics.setdefault(self.global_step, {})[name] = torch.tensor(value).double()
        self._metrics_reduce_type[name] = reduce_type

    def _log_metrics(self) -> None:
        self.flushed.append({step: sorted(m) for step, m in self._metrics.items()})
        self._metrics.clear()
        self._metrics_consistent = True


class SlowCheck(Recorded):
    """Takes its time, as a side-channel exchange does; the save ends meanwhile."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__()
        self.trainer = trainer
        self.recorder: threading.Thread | None = None

    def check(self, rows: Any, *, compared: Any = None) -> None:
        super().check(rows, compared=compared)
        record = self.trainer.record_metric
        self.recorder = threading.Thread(
            target=record, args=(METRIC, 0.3, ReduceType.max), name="AsyncCheckpointExecutor_0"
        )
        self.recorder.start()
        time.sleep(0.3)


def test_a_metric_recorded_from_another_thread_during_a_flush_waits_for_the_next():
    trainer = Trainer()
    trainer.record_metric("train/CE loss", 2.0, ReduceType.mean)
    check = SlowCheck(trainer)
    unhook = rg_olmo.hook_metric_flush(trainer, check)  # type: ignore[arg-type]
    try:
        trainer._log_metrics()
        assert check.recorder is not None
        check.recorder.join(5)
        # Compared and reduced: the loss alone; the save's metric is the next flush's.
        assert check.calls[-1][1] == (Row(1, (("train/CE loss", "mean"),)),)
        assert trainer.flushed == [{1: ["train/CE loss"]}]
        assert list(trainer._metrics[1]) == [METRIC]
    finally:
        unhook()
    assert not {"_log_metrics", "record_metric"} & set(vars(trainer))


# -- 2 ranks under torchrun ---------------------------------------------------------------

SCENARIOS = [
    "same_step",
    "same_step_names_differ",
    "split_steps",
    "after_first_flush",
    "after_first_flush_names_differ",
]
#: The whole launch: 5 two-step fits, about 15 s on two shared cores.
LAUNCH_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("olmo_core_async")
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "tests" / "e2e" / "olmo_core_async_job.py"), str(out), *SCENARIOS]
    result = run_job(cmd, timeout_s=LAUNCH_TIMEOUT_S, cwd=out)
    assert result.returncode == 0, result.output[-6000:]
    return result.output, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.framework
def test_saves_that_end_at_one_step_on_every_rank_are_silent(job):
    for rank in job[1]:
        for name in ("same_step", "same_step_names_differ"):
            result = rank[name]
            assert result["outcome"] == "ok" and result["warnings"] == [], (name, result)
            assert result["counters"]["save_metric_step"] == 0 and result["counters"]["steps"] == 2


@pytest.mark.framework
def test_a_save_that_ends_a_step_later_on_one_rank_is_named_at_the_first_flush(job):
    # Rank 0's save ends at step 0, rank 1's during step 1: both before OLMo-core's first
    # flush, which then finds the same names on both ranks and reduces step 0's max on
    # rank 0 alone (unchecked, the flush's all_reduce paired float64[2] with float64[4]).
    output, ranks = job
    assert [r["split_steps"]["counters"]["save_metric_step"] for r in ranks] == [0, 1]
    for rank in ranks:
        result = rank["split_steps"]
        assert result["outcome"] == "MetricMismatchError", result
        assert result["warnings"] == []  # the first thing rankguard says: no verdict before it
        message = result["message"]
        assert message.startswith(
            "Ranks would reduce different metrics in one collective "
            "(OLMo-core's metric flush, step 0)."
        )
        assert f"rank 0 recorded '{METRIC}' (max) at step 0; rank 1 did not." in message
        assert "CheckpointerCallback(save_async=False)" in message
        assert result["counters"]["steps"] == 1  # stopped at step 1's flush, on every rank
    assert "Collective mismatch" not in output and "Deadlock" not in output


@pytest.mark.framework
def test_a_save_that_ends_after_the_first_flush_on_one_rank_is_gathered_and_silent(job):
    # Rank 1's save ends at step 2: OLMo-core's first flush found the names different and
    # gathers them per flush, each step's max reduced with -inf in place: nothing to say.
    for rank in job[1]:
        for name in ("after_first_flush", "after_first_flush_names_differ"):
            result = rank[name]
            assert result["outcome"] == "ok" and result["warnings"] == [], (name, result)
    assert [r["after_first_flush"]["counters"]["save_metric_step"] for r in job[1]] == [0, 2]
    assert not re.search(r"rankguard.*(Collective mismatch|Hang suspected)", job[0])
