"""A preemption that reaches one node only: where each rank stops, what is saved, how it ends.

Per integration installed in this environment, the job its e2e stop test runs on two
simulated nodes (one launcher each, one rank each: ``torchrun --nnodes 2``, Composer's
``composer --world_size 2 --nproc 1 --node_rank N``), with ``RankGuard`` at its defaults
and without any rankguard callback (``RANKGUARD=off``: the same signal at the same step,
the same saver), side by side. Once rank 1 is past its ready step (the loop's 10, the
frameworks' 6) node 1's launcher alone gets SIGTERM, which it passes on to rank 1
(``tests/hang/test_stop_nodes.py``, ``tests/frameworks/test_stop_nodes_e2e.py``):

- ``loop``: the hand-written loop ``tests/e2e/stop_job.py``;
- ``lightning`` / ``hf``: ``tests/e2e/stop_frameworks_job.py`` (Lightning ``ddp`` with a
  ``ModelCheckpoint`` every 1000 steps; the HF Trainer with ``save_strategy="steps"``,
  every 1000);
- ``olmo_core`` and ``composer``: ``tests/e2e/olmo_core_stop_job.py`` and
  ``tests/e2e/composer_stop_job.py``.

Each cell: the step each rank's fit ended after (its ``OUT/rank{N}.json``; "-" where
the rank wrote none), the checkpoint(s) of that step in the job's checkpoint folder
("none"; any other entry there in brackets, e.g. OLMo-core's ``step0``), each
rank's exit code as its launcher names it (else the launcher's own: node 1's torchrun,
itself signalled, names none), and the seconds from the signal to the last launcher's
end. A job still running ``--cap`` seconds after its start is killed: "hangs (killed at
60 s)". Usage::

    python benchmarks/preemption.py [--cap 60] [--integrations loop,lightning,hf,olmo_core,composer]

with ``PYTHONPATH=src:.`` from the repository root, in either environment (Composer's
only where it is installed). Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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

from benchmarks.launch import Ended, finish, job_env, signal_node, start_nodes  # noqa: E402

E2E = ROOT / "tests" / "e2e"
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


def run_nodes(
    script: str, args: list[str], launcher: str = "torchrun", ready: str = "signalled.json"
) -> Callable:
    """The job on two nodes; SIGTERM to node 1's launcher once rank 1 wrote ``ready``.

    ``args``: the job's arguments, ``{out}`` its output folder.
    """
    pattern = _COMPOSER_CODE if launcher == "composer" else _TORCHRUN_CODE

    def run(rankguard: bool, cap_s: float) -> Run:
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            env = _env(rankguard, OLMO_SHARED_FS="1")  # the nodes share this machine's disk
            job_args = [arg.format(out=tmp) for arg in args]
            procs = start_nodes(
                E2E / script, job_args, 2, 1, env=env, merge_output=True, launcher=launcher, cwd=out
            )
            signalled = signal_node(procs, out / ready, node=1, timeout_s=cap_s)
            left = cap_s - (time.monotonic() - started) if signalled is not None else 5.0
            ended = finish(procs, max(0.0, left))
            run = _collect(out, ended, signalled, Run())
            if signalled is None:
                run.error = "rank 1 never reached its ready step"
            for rank, node in enumerate(ended):  # one rank per node
                named = dict(pattern.findall(node.stdout))
                code = named.get(str(rank))
                if code is None:
                    code = "0" if node.returncode == 0 else f"{launcher} {node.returncode}"
                run.codes[rank] = code
            return run

    return run


#: Each integration: its label, the module it needs, how it runs.
INTEGRATIONS: dict[str, tuple[str, str, Callable[[bool, float], Run]]] = {
    "loop": ("hand-written loop", "torch", run_nodes("stop_job.py", ["{out}"], ready="ready")),
    "lightning": (
        "Lightning",
        "lightning",
        run_nodes("stop_frameworks_job.py", ["lightning", "{out}", "launcher"]),
    ),
    "hf": (
        "HF Trainer",
        "transformers",
        run_nodes("stop_frameworks_job.py", ["hf", "{out}", "launcher"]),
    ),
    "olmo_core": (
        "OLMo-core",
        "olmo_core",
        run_nodes("olmo_core_stop_job.py", ["{out}", "launcher"]),
    ),
    "composer": (
        "Composer",
        "composer",
        run_nodes("composer_stop_job.py", ["{out}", "launcher"], launcher="composer"),
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
        f"torch {torch.__version__}; 2 gloo ranks on two simulated nodes (a launcher each); "
        "node 1's launcher alone gets SIGTERM (the loop: rank 1 past step 10; the frameworks: "
        "past step 6). Per cell: the step each rank's fit ended after (rank 0 / rank 1), the "
        "checkpoint of that step (the folder's other entries in brackets), each rank's exit "
        "code as its launcher names it, seconds from the signal to the last launcher's end."
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
