"""What split the ranks, named from each rank's history, in real 2-rank runs (CPU, gloo).

One launch per cause, in the integration where users meet it, every rankguard setting at
its default but the report folder. Each ends every rank with :data:`DEADLOCK_EXIT_CODE`
seconds after the split, and the first sentence names what split the ranks, not where
they wait:

- a backward skipped on one rank: a DDP loop over a tiny BERT that does ``continue`` on
  a non-finite loss (``tests/e2e/split_cause_job.py``), and Lightning's manual
  optimization whose ``training_step`` returns before ``self.manual_backward``
  (``tests/e2e/split_cause_lightning_job.py``);
- accumulation windows that differ: the loop steps once a window holds 16 tokens, counted
  on each rank; the HF Trainer's ``gradient_accumulation_steps`` worked out on each rank
  (``tests/e2e/split_cause_hf_job.py``);
- a pass that ends earlier on one rank: the loop over per-rank streams of 5 and 8 batches.

Without rankguard each of these jobs hangs silently until the process group's timeout.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from rankguard.callbacks.hang.hang_watchdog import DEADLOCK_EXIT_CODE
from tests.mp import ROOT, run_job

pytestmark = pytest.mark.framework

BIN = Path(sys.executable).parent
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
LAUNCH_TIMEOUT_S = 150
#: From the split to the report and to the job's end: about 6 s on an idle machine (two
#: exchanges a second apart once both ranks waited 3 s), held at twice this machine's load.
REPORT_WITHIN_S = 20.0

#: Per case: how it is launched (the job script after the launcher, its arguments) and the
#: first sentence rankguard prints (after "Deadlock: ").
CASES = {
    "loop-skipped_backward": (
        [*TORCHRUN, "split_cause_job.py"],
        ["skipped_backward"],
        "rank 1 ran no backward for train batch 5 (it waits in train batch 6's forward; "
        "rank 0 waits in train batch 5's backward)",
    ),
    "lightning-manual_backward": (
        [sys.executable, "split_cause_lightning_job.py"],
        [],
        "rank 1 ran no backward for train batch 5 (it waits after train batch 5; rank 0 waits "
        "in train batch 5's backward)",
    ),
    "loop-uneven_windows": (
        [*TORCHRUN, "split_cause_job.py"],
        ["uneven_windows"],
        "the ranks' accumulation windows differ: rank 0 ends one after 2 backward passes, in "
        "train batch 1, and steps its optimizer; rank 1 does not, its window goes on past 2: "
        "it ends it after 3, at train batch 2 (",
    ),
    "hf-uneven_windows": (
        [*TORCHRUN, "split_cause_hf_job.py"],
        [],
        "the ranks' accumulation windows differ: rank 0 ends one after 2 backward passes, in "
        "train batch 0, and steps its optimizer; rank 1 does not, its window goes on past 2: "
        "it ends it after 3, at train batch 0 (",
    ),
    "loop-uneven_pass": (
        [*TORCHRUN, "split_cause_job.py"],
        ["uneven_pass"],
        "rank 0's pass over the train loader ended after 5 batches (train batch 4 its last); "
        "rank 1 went on to train batch 5 in its pass (it waits in train batch 5's ",
    ),
}
#: The verdict's class where it is not a deadlock: DDP's bucket against its buffer broadcast is
#: a desync (the record of collectives tells both, docs/hang.md), the histories its cause.
CLASSES = {"loop-skipped_backward": "desync"}
#: The fix each cause's "Next" gives.
FIXES = {
    "skipped_backward": "Next: decide a skip on every rank together: rank 1 left a batch",
    "manual_backward": "Next: decide a skip on every rank together: rank 1 left a batch",
    "uneven_windows": "Next: keep the accumulation windows equal on every rank",
    "uneven_pass": "Next: give every rank the same number of batches per pass: rank 0's pass",
}


def _launch(tmp_path: Path, case: str) -> tuple[Path, str, int, float]:
    launcher, args, _ = CASES[case]
    *start, script = launcher
    cmd = [*start, str(ROOT / "tests" / "e2e" / script), str(tmp_path), *args]
    job = run_job(cmd, timeout_s=LAUNCH_TIMEOUT_S, cwd=tmp_path)
    return tmp_path, job.output, job.returncode, job.ended_at


#: Each rank's last line before ``os._exit``: the rank and the code it ends with.
ENDING = re.compile(r"\[rank (\d+)\] INFO \S+: rankguard: ending \([^)]*\) with exit code (\d+)")


def _exit_codes(case: str, output: str, returncode: int) -> None:
    """Every rank ended itself with 70 (Lightning's rank 0 is the job's exit code).

    Each rank logs its end, then exits. torchrun lists the exit codes it saw before it
    stopped the others: the first rank to exit, and any that exited by its next look
    (0.1 s), so a rank that exits a few ms later is stopped, not listed.
    """
    if case.startswith("lightning"):
        assert returncode == DEADLOCK_EXIT_CODE, output[-6000:]
        return
    assert sorted(ENDING.findall(output)) == [("0", "70"), ("1", "70")], output[-6000:]
    codes = set(re.findall(r"exitcode\s*:\s*(-?\d+) \(pid", output))  # torchrun's
    assert codes == {str(DEADLOCK_EXIT_CODE)}, output[-6000:]


@pytest.mark.parametrize(
    "case",
    [
        *CASES,
        pytest.param("loop-skipped_backward", marks=pytest.mark.older, id="older-loop"),
    ],
)
def test_what_split_the_ranks_leads_the_report_and_ends_every_rank_with_70(case, tmp_path):
    out, output, returncode, ended_at = _launch(tmp_path, case)
    _exit_codes(case, output, returncode)
    first = CASES[case][2]
    summary = (out / "reports" / "summary.txt").read_text()
    assert summary.startswith(f"{CLASSES.get(case, 'deadlock')}, {first}"), summary
    heading = CLASSES.get(case, "deadlock").capitalize()
    assert output.count(f"{heading}: {first}") == 2, output[-6000:]  # each rank's ERROR line
    assert "Where they wait: " in summary, summary
    assert FIXES[case.split("-", 1)[1]] in summary, summary
    assert f"exit code {DEADLOCK_EXIT_CODE}, do not restart" in summary
    assert output.count(f"Now aborting with exit code {DEADLOCK_EXIT_CODE}.") == 2, output[-6000:]
    split = json.loads((out / "split.json").read_text())
    reported = (out / "reports" / "summary.txt").stat().st_mtime
    assert reported - split["t"] < REPORT_WITHIN_S, reported - split["t"]
    assert ended_at - split["t"] < REPORT_WITHIN_S + 5, ended_at - split["t"]
    assert not list(out.glob("rank*.json")), "a rank's fit returned"
