"""A rank whose training raises, staged in each integration's real 2-rank job (CPU, gloo).

The field report: rank 1's data check in the user's code (``check_batch``) raises
``ValueError("sample 4711 has no tokens after filtering")`` at train step 6, and its
process then stays alive in its teardown, as NCCL's communicator teardown waits for a
peer (here the script's ``finally`` calls ``destroy_process_group_waits()``, a long
sleep); rank 0 goes on into its next collective. Without rankguard the job waits for
gloo's timeout (30 min). With ``RankGuard(hang_watchdog={"report_dir": ...,
"teardown_timeout_s": 3})``, every other setting at its default, each launch shows:

- rank 0 ends with exit code 70 (a code fault), its log leading with
  ``Rank 1 raised ValueError: sample 4711 has no tokens after filtering.``, the user's
  line (``check_batch``), its phase (``train batch 6``: six steps done), where rank 0
  waited and what to do next; rank 1 logs once that it raised and told the others, with
  its traceback (its ``finally`` may never let Python print it);
- ``summary.txt`` (written by rank 0, the lowest rank that did not raise) leads with the
  same sentence;
- rank 1's process ends, at the bound (70) or by its launcher;
- every process of the job has ended within seconds of the raise, not at the harness's
  kill.

One launch per integration, each in a folder of its own (the scenario ends the job): the
hand-written loop under torchrun (no ``framework`` marker: it runs in both worlds), the
HF Trainer and OLMo-core under torchrun, Lightning ``ddp`` (rank 1 is rank 0's child,
which nobody ends: this process reaps it and reads its exit code), and Composer
(``composer -n 2``, in its world: the wrapper of ``Trainer.fit`` found at ``INIT`` sees
the error). Jobs: ``tests/e2e/*_job.py``, scenario ``data_check_raises``. The healthy
counterpart, a data check whose error the loop itself catches, is the loop's ``healthy``
scenario (``tests/frameworks/test_healthy_e2e.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import pytest

from rankguard.callbacks.hang.faults import is_alive
from rankguard.callbacks.hang.hang_watchdog import DEADLOCK_EXIT_CODE
from tests.frameworks.test_hang_e2e import _subreaper
from tests.mp import ROOT, run_job

BIN = Path(sys.executable).parent
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
SCENARIO = "data_check_raises"
SENTENCE = "Rank 1 raised ValueError: sample 4711 has no tokens after filtering."
#: The harness's kill: far above what a launch takes (a passing one: 10-25 s on 2 cores).
LAUNCH_TIMEOUT_S = 120
#: From the raise to rank 0's summary: a poll once rank 0's loop waits, or an exchange's
#: timeout (10 s at the defaults) if one was under way.
REPORT_WITHIN_S = 15.0
#: From the raise to the end of every process of the job (the bound is 3 s).
ENDED_WITHIN_S = 30.0


@dataclass(frozen=True)
class Job:
    script: str
    launcher: list[str]
    needs: str | None  # the framework's module
    site: str = ""  # the file of the scenario's code, where not the script (the report names it)


JOBS = {
    "loop": Job("torch_loop_job.py", TORCHRUN, None, "harness.py"),
    "hf_trainer": Job("hf_trainer_job.py", TORCHRUN, "transformers", "hang.py"),
    # Lightning starts rank 1 itself; every job's scenarios' code lives in
    # tests/e2e/<framework>_concerns/.
    "lightning": Job("lightning_job.py", [sys.executable], "lightning", "hang.py"),
    "composer": Job("composer_job.py", [str(BIN / "composer"), "-n", "2"], "composer", "hang.py"),
    "olmo_core": Job("olmo_core_job.py", TORCHRUN, "olmo_core", "hang.py"),
}


@dataclass
class Raised:
    out: Path
    output: str
    returncode: int
    raised_at: float  # Unix time rank 1's data check raised
    ended_at: float  # Unix time the launcher ended
    rank1_gone_at: float | None  # Unix time rank 1's process was seen gone
    rank1_code: int | None  # its exit code where this process reaped it (Lightning)


def _wait_gone(pid: int, timeout_s: float) -> tuple[float | None, int | None]:
    """When process ``pid`` was seen gone, and its exit code if it was this process's to reap."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not this process's child: its parent reaps it
            if not is_alive(pid):
                return time.time(), None
        else:
            if done:
                return time.time(), os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    return None, None


def _launch(factory, name: str) -> Raised:
    job = JOBS[name]
    if job.needs is not None and find_spec(job.needs) is None:
        pytest.skip(f"needs {job.needs}")
    out = factory.mktemp(f"raise_{name}")
    cmd = [*job.launcher, str(ROOT / "tests" / "e2e" / job.script), str(out), SCENARIO]
    rank1: dict[str, float | int | None] = {}

    def rank1_ends() -> None:  # before the harness kills what is left of the job
        pid = int((out / "pid1").read_text())
        rank1["gone_at"], rank1["code"] = _wait_gone(pid, ENDED_WITHIN_S)

    # Lightning's rank 0 starts rank 1 and ends without it: it becomes this process's child.
    reaper = _subreaper() if name == "lightning" else contextlib.nullcontext()
    with reaper:
        done = run_job(cmd, timeout_s=LAUNCH_TIMEOUT_S, cwd=out, after_exit=rank1_ends)
    raised = json.loads((out / "raised.json").read_text())
    assert raised["rank"] == 1
    return Raised(
        out,
        done.output,
        done.returncode,
        raised["t"],
        done.ended_at,
        rank1.get("gone_at"),
        rank1.get("code"),
    )


def _rank0_exit_code(name: str, launch: Raised) -> int | None:
    """Rank 0's exit code as its launcher tells it (rank 1's is checked apart)."""
    output = launch.output
    if name == "lightning":  # rank 0 is the launched process
        return launch.returncode
    if name == "composer":
        found = re.search(r"Global rank 0 \(PID \d+\) exited with code (-?\d+)", output)
        return int(found.group(1)) if found else None
    found = re.search(r"failed \(exitcode: (-?\d+)\) local_rank: 0 ", output)  # torchrun's
    return int(found.group(1)) if found else None


def _rank1_ended_as_allowed(name: str, launch: Raised) -> None:
    """Rank 1 ended at the bound (70) or by its launcher's SIGTERM, and nothing else."""
    output = launch.output
    if name == "lightning":  # nobody but the bound ends it
        assert launch.rank1_code == DEADLOCK_EXIT_CODE, (launch.rank1_code, output[-6000:])
        stacks = (launch.out / f"reports_{SCENARIO}" / "rank1.txt").read_text()
        assert "in destroy_process_group_waits" in stacks  # where its teardown waited
        assert "Ending it with exit code 70 (teardown_timeout_s)" in output
    elif name == "composer":
        found = re.search(r"Global rank 1 \(PID \d+\) exited with code (-?\d+)", output)
        assert found and int(found.group(1)) in (DEADLOCK_EXIT_CODE, 143, -15), output[-6000:]
    else:  # torchrun names rank 1 only if it ended before its SIGTERM
        codes = re.findall(r"rank\s*: 1 \(local_rank: 1\)\s*\n\s*exitcode\s*: (-?\d+)", output)
        assert set(codes) <= {str(DEADLOCK_EXIT_CODE), "-15"}, output[-6000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "loop",
        pytest.param("hf_trainer", marks=pytest.mark.framework),
        pytest.param("lightning", marks=pytest.mark.framework),
        pytest.param("composer", marks=pytest.mark.framework),
        pytest.param("olmo_core", marks=pytest.mark.framework),
    ],
)
def test_rank_whose_data_check_raises_ends_the_job_with_70_naming_its_line(name, tmp_path_factory):
    launch = _launch(tmp_path_factory, name)
    output = launch.output
    assert _rank0_exit_code(name, launch) == DEADLOCK_EXIT_CODE, output[-6000:]
    # rank 0's summary: the sentence, the user's line, the step; where it waited; what next
    summary = (launch.out / f"reports_{SCENARIO}" / "summary.txt").read_text()
    first, waited, next_step, *_ = summary.splitlines()
    script = JOBS[name].site or JOBS[name].script
    assert re.match(
        rf"{re.escape(SENTENCE)} At {script}:\d+ \(check_batch\): "
        r'raise ValueError\("sample 4711 has no tokens after filtering"\); '
        r"train batch 6, host ",
        first,
    ), summary
    assert re.match(
        rf"Rank 0 waited in \w+ at {script}:\d+ \(\w+\): .*; it ends with exit code 70 "
        r"\(a code fault ",
        waited,
    ), summary
    assert next_step.startswith("Next: fix the error on rank 1"), summary
    assert "This is rank 0, " in summary
    # ... is what rank 0 logged at ERROR, once; rank 1 logged once that it told the others
    logged = [line for line in output.splitlines() if line.endswith(f"hang_watchdog: {first}")]
    assert len(logged) == 1, output[-6000:]
    assert "rankguard.callbacks.hang_watchdog" in logged[0] and "ERROR" in logged[0]
    assert f"{waited}\n{next_step}\n" in output
    assert output.count("This is rank 0, ") == 1 and "Now ending with exit code 70." in output
    told = f"{first} Told the other ranks. Those still training end with exit code 70"
    assert output.count(told) == 1, output[-6000:]
    # rank 1's process ended, and every process of the job did within seconds of the raise
    _rank1_ended_as_allowed(name, launch)
    assert launch.rank1_gone_at is not None, output[-6000:]
    reported = (launch.out / f"reports_{SCENARIO}" / "summary.txt").stat().st_mtime
    assert reported - launch.raised_at < REPORT_WITHIN_S, reported - launch.raised_at
    ended = max(launch.ended_at, launch.rank1_gone_at)
    assert ended - launch.raised_at < ENDED_WITHIN_S, ended - launch.raised_at
