"""A preemption signal that reaches one rank only, in Composer's and OLMo-core's real 2-rank jobs.

The field report: a scheduler's SIGTERM reaches rank 1 only; Composer's own handler
(``sys.exit(143)``) or OLMo-core's (``cancel_run`` on that rank alone) ends or saves on
that rank while the other waits in its next collective until the process group's
timeout. With ``RankGuard`` at its defaults each launch shows, rank 1 having sent itself
SIGTERM after train step 6:

- every rank's fit ends after the same step, past 6 (``OUT/rank{N}.json``, written by
  the job after its fit), within the stop's grace of the signal;
- the framework's own save ran there: Composer's ``CheckpointSaver`` saved that batch
  (``ep0-ba{N}-rank0.pt``; under FSDP2's sharded checkpoints ``ep0-ba{N}/`` with every
  rank's part, the launcher's kill of the others after the first exit cutting none
  short), OLMo-core's checkpointer that step, every rank's part (``step{N}``: the
  model's ``.metadata`` and each rank's ``train/rank{r}.pt``);
- each process exits with 75 (the launcher names both);
- each rank logs one rankguard WARNING, the "Preempted" one, and no rankguard ERROR.

Jobs: ``tests/e2e/composer_stop_job.py`` (``composer -n 2``, Composer's world) and
``tests/e2e/olmo_core_stop_job.py`` (torchrun: OLMo-core 3 in today's world, 2.4 in
Composer's, the ``older`` smoke). The hand-written loop's counterpart: tests/hang/test_stop.py.
"""

from __future__ import annotations

import json
import re
import sys
import zipfile
from importlib.util import find_spec
from pathlib import Path

import pytest

from rankguard.callbacks.hang.stop import STOP_EXIT_CODE
from tests.mp import ROOT, run_job

BIN = Path(sys.executable).parent
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
#: The harness's kill: far above what a launch takes (a passing one: 10-25 s on 2 cores).
LAUNCH_TIMEOUT_S = 150
SIGNAL_AT = 6
#: The stop's grace (``stop_grace_s``'s default): every rank stopped within it of the signal.
GRACE_S = 20.0

COMPOSER = [str(BIN / "composer"), "-n", "2"]
#: Each launch: its job and its arguments after the output folder, its launcher, the
#: module it needs.
JOBS = {
    "composer": ("composer_stop_job.py", [], COMPOSER, "composer"),
    "composer_sharded": ("composer_stop_job.py", ["sharded"], COMPOSER, "composer"),
    "olmo_core": ("olmo_core_stop_job.py", [], TORCHRUN, "olmo_core"),
}


def _exit_codes(name: str, output: str) -> dict[int, int]:
    """Each rank's exit code as its launcher names it."""
    if name.startswith("composer"):
        found = re.findall(r"Global rank (\d) \(PID \d+\) exited with code (-?\d+)", output)
    else:  # torchrun's summary of the ranks that ended non-zero
        found = re.findall(r"rank\s*: (\d) \(local_rank: \d\)\s*\n\s*exitcode\s*: (-?\d+)", output)
    return {int(rank): int(code) for rank, code in found}


def _checkpoint_parts(name: str, folder: Path, step: int) -> list[Path]:
    """The files the framework's save of ``step`` writes, every rank's part."""
    if name == "composer":  # a full (unsharded) checkpoint: rank 0 writes it
        return [folder / f"ep0-ba{step}-rank0.pt"]
    if name == "composer_sharded":  # FSDP2's sharded checkpoint: each rank writes its part
        saved = folder / f"ep0-ba{step}"
        return [saved / ".metadata", *(saved / f"__{r}_0.distcp" for r in (0, 1))]
    saved = folder / f"step{step}"
    return [
        saved / "model_and_optim" / ".metadata",
        *(saved / "train" / f"rank{r}.pt" for r in (0, 1)),
    ]


def _rankguard_lines(output: str, rank: int, level: str) -> list[str]:
    return re.findall(rf"\[rank {rank}\] {level} rankguard\.\S+: (.*)", output)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("composer", marks=pytest.mark.framework),
        pytest.param("composer_sharded", marks=pytest.mark.framework),
        pytest.param("olmo_core", marks=pytest.mark.framework),
        pytest.param(
            "olmo_core", marks=[pytest.mark.framework, pytest.mark.older], id="olmo_core_older"
        ),
    ],
)
def test_sigterm_on_rank_1_only_stops_every_rank_after_one_step_saved_exit_75(
    name, tmp_path_factory
):
    script, args, launcher, needs = JOBS[name]
    if find_spec(needs) is None:
        pytest.skip(f"needs {needs}")
    out = tmp_path_factory.mktemp(f"stop_{name}")
    cmd = [*launcher, str(ROOT / "tests" / "e2e" / script), str(out), *args]
    done = run_job(cmd, timeout_s=LAUNCH_TIMEOUT_S, cwd=out)
    output = done.output
    signalled = json.loads((out / "signalled.json").read_text())["at"]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    (step,) = {r["step"] for r in ranks}  # every rank stopped after the same step
    assert step > SIGNAL_AT, ranks
    took = max(r["at"] for r in ranks) - signalled
    assert 0 < took < GRACE_S, took
    missing = [p for p in _checkpoint_parts(name, out / "ckpt", step) if not p.exists()]
    assert not missing, (missing, output[-6000:])
    if name == "composer":
        assert zipfile.is_zipfile(out / "ckpt" / f"ep0-ba{step}-rank0.pt")  # written whole
    # every rank ends through the exit path with 75; the launcher, which stops the others
    # once one rank exits, names 75 for those it saw end (rank 0 leaves last)
    codes = _exit_codes(name, output)
    assert codes and set(codes.values()) == {STOP_EXIT_CODE}, output[-6000:]
    for rank in (0, 1):
        ended = _rankguard_lines(output, rank, "INFO")
        assert any(f"ending (preempted) with exit code {STOP_EXIT_CODE}" in e for e in ended), (
            rank,
            output[-6000:],
        )
    for rank in (0, 1):
        (warning,) = _rankguard_lines(output, rank, "WARNING")
        assert warning.startswith(
            f"rankguard hang_watchdog: Preempted: SIGTERM on rank 1 at step {step}; "
            f"every rank stops after train step {step}"
        ), warning
        assert _rankguard_lines(output, rank, "ERROR") == [], output[-6000:]
    print(f"{name}: every rank stopped after step {step}, {took:.1f} s after the signal")
