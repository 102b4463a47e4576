"""A preemption signal on one rank only: where each rank stops, what is saved, how it ends.

Per integration installed in this environment, the 2-rank gloo job its e2e stop test
runs, with ``RankGuard`` at its defaults and without any rankguard callback
(``RANKGUARD=off``: the same signal at the same step, the same saver), side by side:

- ``loop``: the hand-written loop ``tests/e2e/stop_job.py`` on two simulated nodes (one
  torchrun each); once rank 1 is past step 10 its node's torchrun gets SIGTERM, which
  it passes on to rank 1 (``tests/hang/test_stop_nodes.py``'s launch);
- ``lightning`` / ``hf``: ``tests/e2e/stop_frameworks_job.py`` (Lightning ``ddp`` with a
  ``ModelCheckpoint`` every 1000 steps; the HF Trainer with ``save_strategy="steps"``,
  every 1000), both ranks started directly (``tests/frameworks/test_stop_e2e.py``'s
  launch); rank 1 sends itself SIGTERM after train step 6;
- ``olmo_core`` (torchrun) and ``composer`` (``composer -n 2``):
  ``tests/e2e/olmo_core_stop_job.py`` and ``tests/e2e/composer_stop_job.py``; rank 1
  sends itself SIGTERM after step (batch) 6.

Each cell: the step each rank's fit ended after (its ``OUT/rank{N}.json``; "-" where
the rank wrote none), the checkpoint(s) of that step in the job's checkpoint folder
("none"; any other entry there in brackets, e.g. OLMo-core's ``step0``), each
rank's exit code (or its launcher's where the launcher names none), and the seconds
from the signal to the last rank's (launcher's) end. A job still running ``--cap``
seconds after its start is killed: "hangs (killed at 60 s)". Usage::

    python benchmarks/preemption.py [--cap 60] [--integrations loop,lightning,hf,olmo_core,composer]

with ``PYTHONPATH=src:.`` from the repository root, in either environment (Composer's
only where it is installed). Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from benchmarks.launch import Ended, finish, free_port, job_env, start, start_nodes  # noqa: E402

E2E = ROOT / "tests" / "e2e"
BIN = Path(sys.executable).parent
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
#: torchrun's summary of a rank that ended non-zero; Composer's launcher's line per rank.
_TORCHRUN_CODE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s+exitcode\s*:\s*(-?\d+)")
_COMPOSER_CODE = re.compile(r"Global rank (\d+) \(PID \d+\) exited with code (-?\d+)")


@dataclass
class Run:
    """One job's end, from rank 1's signal."""

    steps: list[str] = field(default_factory=lambda: ["-", "-"])
    checkpoints: list[str] = field(default_factory=list)  # the save of the step stopped after
    others: list[str] = field(default_factory=list)  # the checkpoint folder's other entries
    codes: list[str] = field(default_factory=lambda: ["?", "?"])
    took_s: float | None = None
    timed_out: bool = False
    error: str = ""


def _env(rankguard: bool, **extra: str) -> dict[str, str]:
    return job_env(
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        RANKGUARD="on" if rankguard else "off",
        **extra,
    )


def _collect(out: Path, ended: list[Ended], signalled: float | None, run: Run) -> Run:
    """The ranks' JSON, the checkpoint folder's entries, the time from the signal."""
    for rank in (0, 1):
        record = out / f"rank{rank}.json"
        if record.exists():
            run.steps[rank] = str(json.loads(record.read_text())["step"])
    ckpt = out / "ckpt"
    entries = sorted(p for p in ckpt.iterdir() if not p.is_symlink()) if ckpt.is_dir() else []
    steps = set(run.steps) - {"-"}
    run.checkpoints = [p.name for p in entries if steps and _of_step(p, steps)]
    run.others = [p.name for p in entries if p.name not in run.checkpoints]
    run.timed_out = any(e.timed_out for e in ended)
    if signalled is None:
        run.error = "rank 1 was never signalled"
    else:
        run.took_s = max(e.ended_at for e in ended) - signalled
    return run


def _of_step(entry: Path, steps: set[str]) -> bool:
    """Whether a checkpoint folder's entry is the save of one of ``steps``.

    By its name (``epoch=0-step=15.ckpt``, ``checkpoint-15``, ``step15``, ``ep0-ba15-rank0.pt``);
    the loop's ``{rank}.pt`` by the step saved in it.
    """
    if re.fullmatch(r"\d+\.pt", entry.name):
        import torch

        return str(torch.load(entry, weights_only=True)["step"]) in steps
    return any(re.search(rf"(?<!\d){step}(?!\d)", entry.name) for step in steps)


def _launcher_codes(output: str, pattern: re.Pattern[str], returncode: int) -> list[str]:
    """Each rank's exit code as the launcher names it; else the launcher's own."""
    named = dict(pattern.findall(output))
    if returncode == 0:  # every rank ended 0: torchrun names none
        return [named.get(str(r), "0") for r in (0, 1)]
    return [named.get(str(r), f"launcher {returncode}") for r in (0, 1)]


def _signal_time(path: Path) -> float | None:
    return json.loads(path.read_text())["at"] if path.exists() else None


def run_loop(rankguard: bool, cap_s: float) -> Run:
    """Two torchruns; SIGTERM to node 1's once rank 1 wrote ``ready`` (step 10)."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = {"RANKGUARD": "on" if rankguard else "off"}
        procs = start_nodes(E2E / "stop_job.py", [tmp], nodes=2, per_node=1, env=env)
        ready = out / "ready"
        while not ready.exists() and time.monotonic() - started < cap_s:
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
        signalled = None
        if ready.exists():
            signalled = time.time()
            os.kill(procs[1].pid, signal.SIGTERM)  # node 1's torchrun passes it on to rank 1
        ended = finish(procs, max(0.0, cap_s - (time.monotonic() - started)))
        run = _collect(out, ended, signalled, Run())
        if signalled is None:
            run.error = "rank 1 never reached step 10"
        for rank, node in enumerate(ended):  # one rank per node
            code = next((c for _, c in _TORCHRUN_CODE.findall(node.stderr)), None)
            if code is None:
                code = "0" if node.returncode == 0 else f"torchrun {node.returncode}"
            run.codes[rank] = code
        return run


def run_framework(framework: str, rankguard: bool, cap_s: float) -> Run:
    """``stop_frameworks_job.py`` on two ranks started directly, as a launcher starts them."""
    with tempfile.TemporaryDirectory() as tmp:
        out, port = Path(tmp), str(free_port())
        procs = [
            start(
                [sys.executable, str(E2E / "stop_frameworks_job.py"), framework, tmp],
                env=_env(
                    rankguard,
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE="2",
                    LOCAL_WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port,
                ),
                cwd=out,
            )
            for rank in (0, 1)
        ]
        ended = finish(procs, cap_s)
        run = _collect(out, ended, _signal_time(out / "signal.json"), Run())
        run.codes = [str(e.returncode) for e in ended]
        return run


def run_launched(script: str, launcher: list[str], pattern: re.Pattern[str]) -> Callable:
    """A job under its framework's launcher (``torchrun``, ``composer -n 2``)."""

    def run(rankguard: bool, cap_s: float) -> Run:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            cmd = [*launcher, str(E2E / script), tmp]
            [ended] = finish([start(cmd, env=_env(rankguard), cwd=out)], cap_s)
            run = _collect(out, [ended], _signal_time(out / "signalled.json"), Run())
            run.codes = _launcher_codes(ended.stdout, pattern, ended.returncode)
            return run

    return run


#: Each integration: its label, the module it needs, how it runs.
INTEGRATIONS: dict[str, tuple[str, str, Callable[[bool, float], Run]]] = {
    "loop": ("hand-written loop (2 torchruns)", "torch", run_loop),
    "lightning": ("Lightning", "lightning", lambda rg, cap: run_framework("lightning", rg, cap)),
    "hf": ("HF Trainer", "transformers", lambda rg, cap: run_framework("hf", rg, cap)),
    "olmo_core": (
        "OLMo-core (torchrun)",
        "olmo_core",
        run_launched("olmo_core_stop_job.py", TORCHRUN, _TORCHRUN_CODE),
    ),
    "composer": (
        "Composer (composer -n 2)",
        "composer",
        run_launched("composer_stop_job.py", [str(BIN / "composer"), "-n", "2"], _COMPOSER_CODE),
    ),
}
#: The distribution a module's version is read from.
_DISTRIBUTION = {"composer": "mosaicml", "olmo_core": "ai2-olmo-core"}


def _cell(run: Run, cap_s: float) -> str:
    if run.error and run.took_s is None and run.steps == ["-", "-"]:
        return f"{run.error}; exit {' / '.join(run.codes)}"
    saved = ", ".join(run.checkpoints) or "none"
    if run.others:
        saved += f" (other: {', '.join(run.others)})"
    parts = [
        f"stopped after {' / '.join(run.steps)}",
        f"saved {saved}",
        f"exit {' / '.join(run.codes)}",
    ]
    if run.timed_out:
        parts.append(f"hangs (killed at {cap_s:.0f} s)")
    elif run.took_s is not None:
        parts.append(f"{run.took_s:.1f} s")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=float, default=60.0, help="seconds before a job is killed")
    parser.add_argument(
        "--integrations", default=",".join(INTEGRATIONS), help="which of: " + ",".join(INTEGRATIONS)
    )
    args = parser.parse_args()
    import torch

    print(
        f"torch {torch.__version__}; 2 gloo ranks; rank 1 gets SIGTERM (the loop: at step 10, "
        "through its node's torchrun; the frameworks: from itself after step 6). Per cell: "
        "the step each rank's fit ended after (rank 0 / rank 1), the checkpoint of that step "
        "(the folder's other entries in brackets), each rank's exit code, seconds from the "
        "signal to the last rank's end."
    )
    print("\n| integration | with rankguard | without |\n|---|---|---|")
    for name in args.integrations.split(","):
        label, module, run = INTEGRATIONS[name]
        if find_spec(module) is None:
            continue
        if module != "torch":
            label = f"{label} {version(_DISTRIBUTION.get(module, module))}"
        with_ = run(True, args.cap)
        without = run(False, args.cap)
        print(f"| {label} | {_cell(with_, args.cap)} | {_cell(without, args.cap)} |", flush=True)


if __name__ == "__main__":
    main()
