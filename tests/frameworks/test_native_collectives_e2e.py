"""Desyncs DDP, FSDP2 and a background save produce, named in real 2-rank loops (gloo, CPU).

Three launches of ``tests/e2e/native_collectives_job.py`` under torchrun, every setting at
its default (a report folder only), each ending every rank with exit code 70 within
seconds of the split:

- DDP with module buffers: rank 1's loss guard skips its backward, so its next forward's
  buffer broadcast meets rank 0's gradient all-reduce (ms-swift#10183);
- FSDP2: rank 1 runs a forward more, so its all-gathers meet rank 0's backward's
  (torchtitan#4777);
- ``dcp.async_save`` every step and the training thread's barrier after it: two threads
  on one process group (KempnerForge#104).

Each runs in both worlds: today's torch, and torch 2.7 (Composer's world, marker
``older``). On gloo a mismatched collective may pair with the wrong partner instead of
hanging; the tests assert what rankguard names, not how the hang looks.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from rankguard.callbacks.hang.status import DEADLOCK_EXIT_CODE
from tests.mp import ROOT, run_job

pytestmark = pytest.mark.framework

TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2"]
LAUNCH_TIMEOUT_S = 240
#: Reported within this many seconds of the split, ended within the second (measured 6 s and
#: 12 s on 2 cores under load; bounds for twice that load).
REPORT_WITHIN_S = 30.0
END_WITHIN_S = 45.0
#: Each world runs one of the two: today's torch, or torch 2.7 in Composer's environment.
WORLDS = [
    pytest.param("today", id="today"),
    pytest.param("torch 2.7", marks=pytest.mark.older, id="torch-2.7"),
]


def _launch(factory, scenario: str) -> tuple[Path, str, int, float]:
    out = factory.mktemp(scenario)
    script = ROOT / "tests" / "e2e" / "native_collectives_job.py"
    job = run_job([*TORCHRUN, str(script), str(out), scenario], timeout_s=LAUNCH_TIMEOUT_S, cwd=out)
    return out, job.output, job.returncode, job.ended_at


@pytest.fixture(scope="module", params=WORLDS)
def ddp(request, tmp_path_factory):
    return _launch(tmp_path_factory, "ddp_buffers")


@pytest.fixture(scope="module", params=WORLDS)
def fsdp2(request, tmp_path_factory):
    return _launch(tmp_path_factory, "fsdp2_forward")


@pytest.fixture(scope="module", params=WORLDS)
def async_save(request, tmp_path_factory):
    return _launch(tmp_path_factory, "async_save")


def _ended_with_70(out: Path, scenario: str, output: str, returncode: int, ended_at: float) -> str:
    """Both ranks reported and exited with 70, in time; the report's text."""
    assert returncode != 0, output[-6000:]
    codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", output))
    assert codes == {str(DEADLOCK_EXIT_CODE)}, output[-6000:]
    assert output.count(f"Now aborting with exit code {DEADLOCK_EXIT_CODE}.") == 2, output[-6000:]
    summary = out / f"reports_{scenario}" / "summary.txt"
    split = json.loads((out / "split.json").read_text())["t"]
    assert summary.stat().st_mtime - split < REPORT_WITHIN_S, summary.stat().st_mtime - split
    assert ended_at - split < END_WITHIN_S, ended_at - split
    return summary.read_text()


def test_ddp_buffers_broadcast_against_a_gradient_bucket_is_a_desync_naming_both(ddp):
    out, output, returncode, ended_at = ddp
    text = _ended_with_70(out, "ddp_buffers", output, returncode, ended_at)
    first = text.splitlines()[0]
    # what split them leads (rank 1's history), the record's proof follows it
    assert first == (
        "desync, rank 1 ran no backward for train batch 4 (it waits in train batch 5's forward; "
        "rank 0 waits in train batch 4's backward)"
    ), first
    assert re.search(
        r"^Where they wait: every rank waits for a collective another never issued: collective "
        r"#\d+ of the default group \(ranks 0,1\) is a different call on different ranks: rank 0: "
        r"all_reduce float32\[1,346\], gradient bucket 0 of train batch 4's backward \(DDP\); "
        r"rank 1: broadcast float32\[128\], module buffers in train batch 5's forward \(DDP's "
        r"broadcast_buffers\)$",
        text,
        re.MULTILINE,
    ), text
    assert "Next: decide a skip on every rank together: rank 1 left a batch" in text, text
    assert "rank 1: your code at native_collectives_job.py" in text, text


def test_fsdp2_all_gathers_of_a_forward_more_are_a_desync_naming_module_and_pass(fsdp2):
    out, output, returncode, ended_at = fsdp2
    text = _ended_with_70(out, "fsdp2_forward", output, returncode, ended_at)
    first = text.splitlines()[0]
    assert first.startswith("desync, every rank waits for a collective another never issued:")
    # torch 2.13's FSDP2 all-gathers with all_gather_single, 2.7's with all_gather_into_tensor
    assert re.search(
        r"rank 0: all_gather_(single|into_tensor) float32\[136\], FSDP's all-gather of the "
        r"parameters of module '2' for train batch 2's backward; rank 1: ",
        first,
    ), first
    assert "rank 1: " in first and "module '0' for train batch 2's forward" in first, first
    assert "Next: rank 1 issued FSDP's all-gather of the parameters of module '0'" in text, text
    assert 'COUNTERS["debug"] = int(net(x[:1]).argmax())' in text, text  # rank 1's own line


def test_a_background_save_and_the_training_threads_barrier_on_one_group_are_a_race(async_save):
    out, output, returncode, ended_at = async_save
    text = _ended_with_70(out, "async_save", output, returncode, ended_at)
    first = text.splitlines()[0]
    assert re.match(
        r"two threads issued collectives on the default group \(ranks 0,1\) in a different "
        r"order on different ranks: threads MainThread, "
        r"(AsyncCheckpointExecutor_0|ThreadPoolExecutor-\d+_\d+); collective #\d+: ",
        first,
    ), first
    assert "barrier at native_collectives_job.py" in first and "gather_object" in first, first
    assert "Next: one thread per process group." in text, text
