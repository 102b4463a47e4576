"""HangWatchdog in real 2-rank trainings: Composer (``composer -n 2``) and Lightning (``ddp``).

Three launches, each ending in a real hang that the watchdog must report and
end with exit code 75 on every rank; the first two start with a healthy run
whose eval is 5x slower than its train steps, which must raise no alarm:

- Composer: healthy run, then rank 1 blocks in a hook after eval: reported at
  the calibrated deadline (stage 1), ended at the ceiling (stage 2);
- Lightning: healthy run that saves a checkpoint, a run resumed from it that
  starts calibrated, then rank 1 blocks in ``on_validation_end``;
- Composer: after eval, rank 1 calls an ``all_reduce`` that rank 0 never calls:
  a proven deadlock, ended at once with exit code 70.

Then ``rankguard report`` runs on the first hang's report directory. Every
launch has a hard timeout after which its whole process group is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import pytest

from rankguard.callbacks.hang.hang_watchdog import DEADLOCK_EXIT_CODE, HANG_EXIT_CODE
from rankguard.report.timeline import plot_timeline
from tests.e2e.hang_settings import EVAL_BATCH_S, HANG, HEALTHY, TRAIN_STEP_S, TWO_STAGE
from tests.mp import run_job

pytestmark = pytest.mark.framework

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
COMPOSER_JOB = ROOT / "tests" / "e2e" / "composer_job.py"
LIGHTNING_JOB = ROOT / "tests" / "e2e" / "lightning_job.py"
LAUNCH_TIMEOUT_S = 180
# Set by a launcher or a cluster: each job picks its own rendezvous.
POST_EVAL_DEADLINE_S = HANG["post_eval_timeout_s"]
REPORT_MARGIN_S = 3.0  # report within the deadline + this, from the stall's start
PR_SET_CHILD_SUBREAPER = 36


@dataclass
class Launch:
    out: Path
    returncode: int
    output: str
    ended_at: float  # Unix time the launch's first process ended


def _launch(cmd: list[str], out: Path, after_exit=None) -> Launch:
    """Runs ``cmd`` in its own session; kills the session after LAUNCH_TIMEOUT_S."""
    job = run_job(cmd, timeout_s=LAUNCH_TIMEOUT_S, cwd=out, after_exit=after_exit)
    return Launch(out, job.returncode, job.output, job.ended_at)


def _composer(out: Path, *scenarios: str) -> Launch:
    return _launch([str(BIN / "composer"), "-n", "2", str(COMPOSER_JOB), str(out), *scenarios], out)


@contextlib.contextmanager
def _subreaper():
    """Makes this process the parent of its orphaned descendants, to read their exit codes."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.skip("needs prctl(PR_SET_CHILD_SUBREAPER) (Linux)")
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def _reap(pid: int, timeout_s: float) -> int | None:
    """The exit code of orphaned descendant ``pid`` once it ends; ``None`` if unknown."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None  # not ours: its own parent reaped it
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    return None


@pytest.fixture(scope="module")
def composer_stall(tmp_path_factory) -> Launch:
    return _composer(
        tmp_path_factory.mktemp("composer_hang"), "healthy_slow_eval", "post_eval_stall"
    )


@pytest.fixture(scope="module")
def composer_collective(tmp_path_factory) -> Launch:
    return _composer(tmp_path_factory.mktemp("composer_collective"), "unmatched_collective")


@pytest.fixture(scope="module")
def lightning_stall(tmp_path_factory) -> tuple[Launch, int | None]:
    """The Lightning launch and rank 1's exit code (rank 1 is rank 0's child)."""
    if find_spec("lightning") is None:
        pytest.skip("needs rankguard[lightning]")
    out = tmp_path_factory.mktemp("lightning_hang")
    codes = {}

    def reap_rank1() -> None:
        # Rank 0 has exited; its child rank 1 is now this process's child.
        codes[1] = _reap(int((out / "pid1").read_text()), timeout_s=30)

    cmd = [sys.executable, str(LIGHTNING_JOB), str(out), "healthy_slow_eval", "resume_calibrated"]
    with _subreaper():
        launch = _launch([*cmd, "stall_after_validation"], out, after_exit=reap_rank1)
    return launch, codes.get(1)


def _ranks(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _seconds(summary: str) -> str:
    """The summary with each whole-second count (e.g. ``stuck 4 s``) as ``N s``."""
    return re.sub(r"\b(stuck|waiting) \d+ s\b", r"\1 N s", summary)


def _latency(out: Path, scenario: str) -> float:
    """Seconds from the start of rank 1's stall to the report (summary.txt written)."""
    stall = json.loads((out / f"stall_{scenario}.json").read_text())
    assert stall["rank"] == 1
    return (out / f"reports_{scenario}" / "summary.txt").stat().st_mtime - stall["t"]


def _loop_stack(rank_file: Path) -> str:
    """The training loop's frames in a rank{N}.txt (the thread marked [training loop])."""
    text = rank_file.read_text()
    block = re.search(
        r"^(Current )?Thread 0x[0-9a-f]+ \[training loop\].*?(\n\n|\Z)", text, re.S | re.M
    )
    assert block, text
    return block.group(0)


def _assert_healthy(result: dict) -> None:
    """No alarm, no warning, although a watchdog timing train steps alone would have fired."""
    assert result["outcome"] == "ok", result
    assert result["warnings"] == []
    longest_gap = result["longest_train_gap_s"]
    assert longest_gap > HEALTHY["timeout_s"]  # an eval sits between two train steps
    peaks, deadlines = result["peaks"], result["deadlines"]
    assert peaks["eval"] >= EVAL_BATCH_S and peaks["train"] >= TRAIN_STEP_S  # calibrated
    assert deadlines["train"] < longest_gap  # the calibrated train deadline alone would fire


def test_composer_healthy_run_with_5x_slower_eval_raises_no_alarm(composer_stall):
    for result in _ranks(composer_stall.out):
        healthy = result["healthy_slow_eval"]
        _assert_healthy({**healthy, **healthy["counters"]})
        assert healthy["counters"]["train_batches"] == 8
        assert healthy["counters"]["eval_batches"] == 8
    assert not (composer_stall.out / "reports_healthy_slow_eval").exists()


def _logged(output: str, level: str, text: str) -> list[tuple[float, str]]:
    """(Unix time, message) of the job's log lines at ``level`` that contain ``text``."""
    pattern = rf"^(\d+\.\d+) rankguard\.callbacks\.hang_watchdog {level}: (.*)$"
    return [(float(t), m) for t, m in re.findall(pattern, output, re.M) if text in m]


def test_composer_rank_stalled_after_eval_is_reported_then_every_rank_exits_75_at_the_ceiling(
    composer_stall,
):
    launch = composer_stall
    reports = launch.out / "reports_post_eval_stall"
    ceiling = TWO_STAGE["post_eval_timeout_s"]
    stall = json.loads((launch.out / "stall_post_eval_stall.json").read_text())
    assert launch.returncode == HANG_EXIT_CODE, launch.output[-6000:]
    for rank in (0, 1):  # the launcher's account of each rank
        assert re.search(rf"Global rank {rank} \(PID \d+\) exited with code 75", launch.output)
        assert f"This is rank {rank}, " in launch.output  # each rank logged the verdict
    # Stage 1, once per rank: at the calibrated deadline, and training goes on.
    reported = _logged(launch.output, "WARNING", "Hang suspected: rank 1 stuck")
    assert len(reported) == 2, launch.output[-6000:]
    first = reported[0][1]
    match = re.search(r"\(deadline ([\d.]+) s, calibrated; ceiling 8 s\); rank 0 waiting", first)
    assert match, first
    deadline = float(match.group(1))
    assert TWO_STAGE["floor_s"] <= deadline < ceiling
    assert "in after eval of 'eval'" in first and "in data fetch for train batch 4" in first
    for t, _ in reported:  # at the first deadline passed: rank 1's, or rank 0's as it waits
        assert TWO_STAGE["floor_s"] - 0.5 < t - stall["t"] < deadline + REPORT_MARGIN_S
    # Stage 2, once per rank: the ceiling ends the incident.
    ended = _logged(launch.output, "ERROR", "Hang: rank 1 stuck")
    assert len(ended) == 2 and launch.output.count("Now aborting with exit code 75.") == 2
    for t, _ in ended:
        assert ceiling - 0.5 < t - stall["t"] < ceiling + REPORT_MARGIN_S
    summary = (reports / "summary.txt").read_text()
    assert _seconds(summary).startswith(
        f"rank 1 stuck N s in after eval of 'eval' (deadline {deadline:g} s, calibrated; "
        "ceiling 8 s); rank 0 waiting N s in data fetch for train batch 4 (blocked in all_reduce"
    ), summary
    assert "Next: read rank1.txt" in summary and "Stage 2: the incident ends" in summary
    assert launch.ended_at - (reports / "summary.txt").stat().st_mtime < 10  # then it ended
    assert "stall_after_eval" in _loop_stack(reports / "rank1.txt")
    assert "all_reduce" in _loop_stack(reports / "rank0.txt")
    assert "Connection reset" not in launch.output  # rank 0, which hosts the store, left last


def test_composer_eval_batch_heartbeats_carry_the_batch_that_ran(composer_stall):
    beats = (composer_stall.out / "reports_post_eval_stall" / "rank1.jsonl").read_text()
    phases = [json.loads(line)["phase"] for line in beats.splitlines()]
    ran = [p for p in phases if p.startswith("eval batch")]
    ended = [p for p in phases if p.startswith("after eval batch")]
    assert ran == [f"eval batch {i} of 'eval'" for i in range(4)]
    assert ended == [f"after eval batch {i} of 'eval'" for i in range(4)]


def test_lightning_healthy_run_with_5x_slower_eval_raises_no_alarm(lightning_stall):
    launch, _ = lightning_stall
    for result in _ranks(launch.out):
        healthy = result["healthy_slow_eval"]
        _assert_healthy(healthy)
        assert (healthy["train_steps"], healthy["val_steps"]) == (8, 8)
    assert not (launch.out / "reports_healthy_slow_eval").exists()


def test_lightning_resumed_fit_starts_calibrated_from_the_checkpoint(lightning_stall):
    launch, _ = lightning_stall
    for result in _ranks(launch.out):
        resumed = result["resume_calibrated"]
        assert resumed["outcome"] == "ok" and resumed["warnings"] == []
        assert resumed["train_steps"] == 8  # the second epoch only: it resumed
        (plan,) = resumed["plans"]  # the fit-start line, before any step of this run
        assert "reports at deadlines calibrated from the checkpoint: train " in plan, plan
        assert "train 2 s (ceiling)" not in plan  # not warming up from nothing


def test_lightning_rank_stalled_in_on_validation_end_is_named_and_every_rank_exits_75(
    lightning_stall,
):
    launch, rank1_code = lightning_stall
    reports = launch.out / "reports_stall_after_validation"
    assert launch.returncode == HANG_EXIT_CODE, launch.output[-6000:]  # rank 0
    assert rank1_code == HANG_EXIT_CODE
    assert launch.output.count("Now aborting with exit code 75.") == 2
    summary = (reports / "summary.txt").read_text()
    # Both ranks' last heartbeat is the end of validation: rank 0 is told apart because it
    # is blocked in Lightning's per-step broadcast, and rank 1 is not.
    assert _seconds(summary).startswith(
        "rank 1 stuck N s in after eval of 'val' (deadline 4 s); "
        "rank 0 waiting N s in after eval of 'val' (blocked in broadcast, called from "
        "training_epoch_loop.py:"
    ), summary
    assert "Next: read rank1.txt" in summary
    latency = _latency(launch.out, "stall_after_validation")
    assert POST_EVAL_DEADLINE_S - 0.5 < latency < POST_EVAL_DEADLINE_S + REPORT_MARGIN_S
    assert "stall_after_validation" in _loop_stack(reports / "rank1.txt")
    assert "Connection reset" not in launch.output  # rank 0, which hosts the store, left last


def test_rank_in_an_unmatched_collective_is_a_proven_deadlock_named_with_its_call_site(
    composer_collective,
):
    launch = composer_collective
    reports = launch.out / "reports_unmatched_collective"
    # Every rank waits at a collective, not the same one: proven, ended at once with 70.
    assert launch.returncode == DEADLOCK_EXIT_CODE, launch.output[-6000:]
    for rank in (0, 1):
        assert re.search(rf"Global rank {rank} \(PID \d+\) exited with code 70", launch.output)
    summary = (reports / "summary.txt").read_text()
    assert summary.startswith("deadlock, every rank waits at a rendezvous"), summary
    assert "rank 1 waiting" in summary and "(reduce_on_side_group): torch.distributed" in summary
    # its trainer.fit() line, in the Composer job's harness (tests/e2e/composer_concerns/)
    assert "rank 0: your code at harness.py:" in summary
    assert "blocked in all_reduce, called from trainer.py:" in summary  # Composer's fetch
    assert "Next: fix the code path at rank 1's wait point" in summary, summary
    latency = _latency(launch.out, "unmatched_collective")
    assert latency < POST_EVAL_DEADLINE_S + REPORT_MARGIN_S
    stack = _loop_stack(reports / "rank1.txt")
    assert re.search(r"distributed_c10d\.py\", line \d+ in all_reduce\n", stack), stack
    assert "in reduce_on_side_group" in stack


def test_report_cli_groups_the_real_hangs_stacks_and_draws_the_timeline(composer_stall):
    reports = composer_stall.out / "reports_post_eval_stall"
    proc = subprocess.run(
        [str(BIN / "rankguard"), "report", str(reports)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert _seconds(out).startswith("rank 1 stuck N s in after eval of 'eval'")
    groups = dict(re.findall(r"^== (rank \d) ==\n(.*?)(?=^==|^wrote)", out, re.S | re.M))
    assert set(groups) == {"rank 0", "rank 1"}, out  # two places: two groups
    assert "in stall_after_eval" in groups["rank 1"] and "stall_after_eval" not in groups["rank 0"]
    assert "in all_reduce" in groups["rank 0"]
    assert f"wrote {reports / 'merged.txt'}" in out
    merged = (reports / "merged.txt").read_text()
    assert merged.startswith("rank 1 stuck") and "== rank 1 (1 rank) ==" in merged
    png = (reports / "timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
    image = pytest.importorskip("PIL.Image")
    with image.open(reports / "timeline.png") as picture:
        picture.verify()
        assert picture.size[0] >= 500 and picture.size[1] >= 100


def test_timeline_of_the_real_hang_shows_rank_1_stopping_first_its_deadline_and_ceiling(
    composer_stall,
):
    reports = composer_stall.out / "reports_post_eval_stall"
    records = {r: _jsonl(reports / f"rank{r}.jsonl") for r in (0, 1)}
    timeline = plot_timeline(records, composer_stall.out / "timeline_check.png")
    assert timeline.first == 1
    stuck, waiting = timeline.rows[1], timeline.rows[0]
    # x = 0 is rank 1's last heartbeat, the end of eval; its calibrated deadline is drawn
    # there + the deadline, the ceiling (8 s), where stage 2 ended the incident, + 8.
    report = records[1][-1]
    assert timeline.origin == records[1][-2]["t"] and stuck.last_progress == 0.0
    assert stuck.last_phase == "after eval of 'eval'" and stuck.blocked_in is None
    ceiling = TWO_STAGE["post_eval_timeout_s"]
    assert TWO_STAGE["floor_s"] <= report["deadline_s"] < ceiling == report["ceiling_s"]
    assert timeline.deadline == pytest.approx(report["deadline_s"])
    assert timeline.ceiling == pytest.approx(ceiling) and timeline.ceiling_drawn
    assert ceiling <= stuck.stalled.end < ceiling + REPORT_MARGIN_S
    assert waiting.blocked_in.startswith("all_reduce")  # rank 0 waits for it, in its next fetch
    assert waiting.last_phase == "data fetch for train batch 4"
    # The whole recorded history: each row starts at that rank's first heartbeat.
    assert stuck.spans[0].start == pytest.approx(records[1][0]["t"] - timeline.origin)
    assert {"startup", "train", "data fetch", "eval"} <= {span.phase for span in stuck.spans}
    assert stuck.stalled.phase == "stuck" and waiting.stalled.phase == "waiting"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- The loop and the HF Trainer (torchrun; tests/frameworks/launches.py) ----------------


def assert_rank_1_named_with_its_stack(out: Path, output: str, frame: str) -> None:
    reports = out / "reports"
    summary = (reports / "summary.txt").read_text()
    deadline = HANG["post_eval_timeout_s"]
    assert re.match(
        rf"rank 1 stuck \d+ s in after eval of 'eval' \(deadline {deadline:g} s\); rank 0 ",
        summary,
    ), summary
    assert "Next: read rank1.txt" in summary
    stall = json.loads((out / "stall.json").read_text())
    latency = (reports / "summary.txt").stat().st_mtime - stall["t"]
    assert deadline - 0.5 < latency < deadline + REPORT_MARGIN_S
    assert frame in _loop_stack(reports / "rank1.txt")  # where rank 1's loop stopped
    assert output.count("Now aborting with exit code 75.") == 2


def test_loop_rank_stalled_after_eval_is_named_with_its_stack_and_every_rank_exits_75(
    loop_scenarios,
):
    out, output, _ = loop_scenarios
    assert_rank_1_named_with_its_stack(out, output, "in stall_after_eval")


def test_hf_rank_stalled_after_eval_is_named_with_its_stack_and_every_rank_exits_75(hf_scenarios):
    out, output, _ = hf_scenarios
    assert_rank_1_named_with_its_stack(out, output, "in on_evaluate")
