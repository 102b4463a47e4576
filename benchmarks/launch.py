"""Starts process trees and ends them, whole; launches simulated nodes on one machine.

:func:`start` runs a command in a session of its own, :func:`finish` waits for
one or more such commands under one deadline and then kills whatever is left
of their trees (:func:`kill_tree`). The test harness (``tests/mp.py``), the
docs generator (``docs/generate.py``) and :func:`launch_nodes` (one launcher
per simulated node, torchrun or Composer's, master on 127.0.0.1) all launch
through them; :func:`signal_node` stages a signal that reaches one node only.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Set by a launcher or a cluster: a job started from here must pick its own rendezvous.
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")


#: The C library's resolver: one try of 1 s where it was two of 5 s. torch names every store
#: connection's address (``::ffff:127.0.0.1`` for a local store) through a reverse DNS lookup,
#: on the client as it connects and in the store's server thread as it accepts; the lookup goes
#: to the machine's DNS server, as no hosts file lists that name. Here that server drops a
#: query now and then (6 of 150 connections in a row took 5.0 s each, 2026-11-30), and a
#: dropped query stalled a connection, or the whole store, for 5 or 10 s: timings no test or
#: benchmark means to measure. Unanswered, the name is the address, and torch logs a warning.
RESOLVER_ENV = {"RES_OPTIONS": "timeout:1 attempts:1"}


def job_env(**extra: str) -> dict[str, str]:
    """This process's environment without :data:`LAUNCH_ENV`, with ``extra`` set.

    :data:`RESOLVER_ENV` applies where the environment sets no resolver options of its own.
    """
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    for name, value in RESOLVER_ENV.items():
        env.setdefault(name, value)
    env.update(extra)
    return env


#: Ports :func:`free_port` picks from: below Linux's ephemeral range (32768-60999), from which
#: the kernel gives every outgoing connection its local port and every ``bind(0)`` its port,
#: so a port found free here is not handed to another process before the launcher binds it.
PORTS = range(20000, 32768)


def free_port() -> int:
    """A port no socket holds now, outside the kernel's ephemeral range (see :data:`PORTS`)."""
    rng = random.Random()
    for _ in range(100):
        port = rng.choice(PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORTS.start}-{PORTS.stop - 1} after 100 tries")


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, their children...), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def node_disk(disk: str, mount_point: str) -> list[str]:
    """A command prefix that runs a node's launcher with ``disk`` mounted at ``mount_point``.

    The node's processes see ``disk`` at the same absolute path where the other
    nodes see their own directory: a node-local disk, as on a cluster where
    each node mounts its own NVMe at ``/local``. Needs a private mount
    namespace (``unshare -m``, root or user namespaces); see :func:`can_mount`.
    """
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    namespace = ["unshare", "-m", "--propagation", "private"]
    return [*namespace, "sh", "-c", script, "sh", disk, mount_point]


def can_mount() -> bool:
    """Whether :func:`node_disk` works here."""
    try:
        probe = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "mount", "--bind", "/", "/"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def start(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path | str | None = None,
    merge_output: bool = True,
) -> subprocess.Popen:
    """Starts ``cmd`` in a session of its own, its output piped (stderr into stdout by default).

    A terminal's Ctrl-C does not reach it: :func:`finish` kills it instead.
    """
    return subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_output else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILLs ``proc``, every process below it, and the sessions they lead.

    torchrun starts each rank in a session of its own: killing the launcher's
    session alone would leave the ranks running, holding the output pipes open.
    Below a process that has ended (and was waited for) nothing is looked for,
    as its pid may be another process's by now; what is left of its session is
    still killed.
    """
    targets = [*descendants(proc.pid), proc.pid] if proc.poll() is None else []
    for pid in targets:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for group in {*targets, proc.pid}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)


@dataclass
class Ended:
    """How one command of :func:`finish` ended."""

    returncode: int
    stdout: str
    stderr: str  # "" where it went into stdout
    timed_out: bool  # killed at the deadline
    ended_at: float  # Unix time its output was read to the end


def finish(
    procs: Sequence[subprocess.Popen],
    timeout_s: float,
    after_exit: Callable[[], None] | None = None,
) -> list[Ended]:
    """Waits for ``procs`` (from :func:`start`) until ``timeout_s`` has passed for all together.

    At the deadline every command's tree is killed (:func:`kill_tree`), and
    whatever is left of each when this returns or raises (Ctrl-C, SIGTERM).

    Args:
        procs: The started commands.
        timeout_s: Hard limit for all of them together.
        after_exit: Called once every command ended in time, before what is
            left of their sessions is killed (e.g. to wait for a rank that
            outlives the launcher).
    """
    deadline = time.monotonic() + timeout_s
    ended: list[Ended] = []
    try:
        for proc in procs:
            timed_out = False
            try:
                out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                for each in procs:
                    kill_tree(each)
                out, err = proc.communicate()
            ended.append(Ended(proc.returncode, out, err or "", timed_out, time.time()))
        if after_exit is not None and not any(e.timed_out for e in ended):
            after_exit()
    finally:
        for proc in procs:
            kill_tree(proc)  # whatever is left of any rank
    return ended


def node_launcher(launcher: str, node: int, nodes: int, per_node: int, port: int) -> list[str]:
    """The command that starts one node's ranks: ``torchrun`` or Composer's ``composer``.

    Each launcher starts and watches its own node's ranks only.
    """
    binary = str(Path(sys.executable).parent / launcher)
    if launcher == "composer":
        return [
            *(binary, "--world_size", str(nodes * per_node), "--nproc", str(per_node)),
            *("--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port)),
        ]
    if launcher != "torchrun":
        raise ValueError(f"`launcher` must be 'torchrun' or 'composer'; got {launcher!r}.")
    return [
        binary,
        f"--nnodes={nodes}",
        f"--nproc-per-node={per_node}",
        f"--node-rank={node}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
    ]


def start_nodes(
    script: Path,
    args: list[str],
    nodes: int,
    per_node: int,
    prefix: Mapping[int, Sequence[str]] | None = None,
    env: Mapping[str, str] | None = None,
    merge_output: bool = False,
    launcher: str = "torchrun",
    cwd: Path | str | None = None,
) -> list[subprocess.Popen]:
    """Starts ``script`` on ``nodes`` x ``per_node`` ranks, each node its own launcher.

    ``prefix`` gives a node's launcher a command to run under (e.g. :func:`node_disk`);
    ``env`` adds to this process's environment; ``launcher``: see :func:`node_launcher`.
    :func:`finish` waits for them.
    """
    port = free_port()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    environment = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env or {})}
    return [
        start(
            [
                *(prefix or {}).get(node, ()),
                *node_launcher(launcher, node, nodes, per_node, port),
                str(script),
                *args,
            ],
            env=environment,
            cwd=cwd,
            merge_output=merge_output,
        )
        for node in range(nodes)
    ]


def signal_node(
    procs: Sequence[subprocess.Popen],
    ready: Path,
    node: int = 1,
    timeout_s: float = 90.0,
    signum: int = signal.SIGTERM,
) -> float | None:
    """Once ``ready`` exists, sends ``signum`` to node ``node``'s launcher alone.

    A scheduler's preemption that reaches one node first: the launcher passes it on
    to its own ranks (torchrun, Composer's); no other node's process gets it.

    Args:
        procs: The node launchers, from :func:`start_nodes`.
        ready: The file a rank writes once the job is where the signal should find it.
        node: The node whose launcher gets the signal.
        timeout_s: How long to wait for ``ready``.
        signum: The signal.

    Returns:
        The Unix time it was sent, or ``None`` (``ready`` never came, or a launcher
        ended before it did).
    """
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            return None
        time.sleep(0.05)
    sent = time.time()
    os.kill(procs[node].pid, signum)
    return sent


def launch_nodes(
    script: Path,
    args: list[str],
    nodes: int,
    per_node: int,
    timeout: float,
    prefix: Mapping[int, Sequence[str]] | None = None,
) -> list[subprocess.CompletedProcess]:
    """Runs ``script`` on ``nodes`` x ``per_node`` ranks; each node is its own torchrun.

    After ``timeout`` seconds (for all nodes together) every node's torchrun and
    every process below it are killed (:func:`finish`). ``prefix`` gives a
    node's launcher a command to run under (e.g. :func:`node_disk`).
    """
    procs = start_nodes(script, args, nodes, per_node, prefix)
    return [
        subprocess.CompletedProcess(proc.args, e.returncode, e.stdout, e.stderr)
        for proc, e in zip(procs, finish(procs, timeout), strict=True)
    ]
