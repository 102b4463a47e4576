"""``make docs``: regenerates the pages that must not drift from the code.

* ``docs/reference.md``: every guard in the registry (``GUARDS``), from its
  signature and Google-style docstring: settings and defaults, events,
  errors, metric keys, files.
* ``docs/failures.md``: every ``--fault`` of the examples (``FAULTS``), with
  the prose in ``docs/faults/<fault>.md`` and the real output of every
  example with and without rankguard, recorded in ``docs/outputs/``.
* The failure table in ``README.md`` (between its ``failures`` markers), from
  the same prose files.

Each recorded output starts with the command that produced it, a digest of
the example's code and the framework versions its environment's lock pins
(:func:`example_digest`), and how the run ended; ``docs/outputs/words.json``
lists, per recording, the words of rankguard's code its rankguard lines quote
(:func:`quoted_words`). A recording is stale, and rerun, when rerunning it
could print something else (:func:`staleness`): its example or the pinned
versions changed, or a message it quotes was reworded. A refactoring that keeps
every message reruns nothing; a reworded message reruns the recordings that
quote it; ``--force`` reruns everything. ``tests/docs/test_docs.py`` checks, without
running anything, that no recording is stale and that the pages are what this
script renders from the recordings; the example tests rerun a sample and compare
it with the recordings (:func:`says_otherwise`).

Usage::

    .venv/bin/python docs/generate.py            # or: make docs
    .venv/bin/python docs/generate.py --list     # the runs and why each is stale
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import logging
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is found from the repository
    sys.path.insert(0, str(ROOT))
from benchmarks.launch import finish, job_env, start  # noqa: E402  (each run's process tree)

DOCS = ROOT / "docs"
OUTPUTS = DOCS / "outputs"
PROSE = DOCS / "faults"
EXAMPLES = ROOT / "examples"
#: The recorded report of the ``post_eval_hang`` run, and the timeline drawn from it.
HANG_REPORT = DOCS / "hang-report"
#: rankguard's code: the words (string literals) its recorded lines quote count, see :func:`stale`.
CODE = ("src",)
#: Besides rankguard's code, the fault injection every example shares: its words count too.
SHARED_EXAMPLE_CODE = ("examples/faults.py",)
#: The locks of the environments ``make`` creates: the frameworks' versions an output depends
#: on. Composer's examples run in Composer's world, every other example in today's.
LOCK = ROOT / "requirements.lock"
LOCK_COMPOSER = ROOT / "requirements-composer.lock"
FRAMEWORKS = ("torch", "mosaicml", "lightning", "transformers", "accelerate", "datasets")
#: What one example's output depends on besides :data:`FRAMEWORKS`, by its framework.
FRAMEWORK_PACKAGES = {"olmo": ("ai2-olmo-core",)}
#: Shorter string literals ("rank ", ", ") are too common to tell one message from another.
MIN_WORDS = 12
#: Per recording, the words of rankguard's code it quotes (see :func:`stale`).
WORDS = DOCS / "outputs" / "words.json"
#: How long one example run with rankguard may take before the generator stops it.
RUN_TIMEOUT_S = 600
#: How long one without rankguard may take: the symptom of some faults is a hang (the
#: examples train for about a second); a fault's prose may say otherwise
#: (``stop_without_after_s``).
STOP_WITHOUT_AFTER_S = 90
#: An example joins the catalogue with this line in its docstring: ``<command>  # healthy``;
#: it offers the faults its docstring lists, one a line: ``    <fault>  <what it does>``.
HEALTHY_MARK = "# healthy"

log = logging.getLogger("docs")


# -- what produced an output ----------------------------------------------------------------


def _code_of(path: Path) -> str:
    """A Python file's code without comments, docstrings or layout (its AST)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in _documented(tree):
        node.body[0] = ast.Pass()
    return ast.dump(tree, include_attributes=False)


def _documented(tree: ast.AST) -> list[ast.AST]:
    """The nodes of ``tree`` (module, classes, functions) whose body starts with a docstring."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(body := getattr(node, "body", None), list)
        and body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ]


def framework_of(script: str) -> str:
    """The framework an example script is for, by its name (``hf_trainer.py``: ``hf``)."""
    return script.split("_")[0]


def lock_of(framework: str) -> Path:
    """The lock of the environment the examples of ``framework`` run in."""
    return LOCK_COMPOSER if framework == "composer" else LOCK


def _pinned(package: str, lock: Path) -> str:
    """The version of ``package`` that ``lock`` pins (``-`` where it pins none)."""
    for line in lock.read_text(encoding="utf-8").splitlines():
        name, _, pinned = line.partition("==")
        if name.strip().lower() == package:
            return pinned.strip()
    return "-"


@functools.cache
def example_digest(script: str) -> str:
    """A digest of what makes a run of ``script`` the run it is.

    The example's code (not its comments or docstrings: outputs quote no line
    numbers, see :func:`normalise`) and the framework versions its environment's lock
    pins (:func:`lock_of`). A release upstream changes nothing here until the lock is
    refreshed.
    """
    framework = framework_of(script)
    digest = hashlib.sha256(_code_of(EXAMPLES / script).encode())
    for package in (*FRAMEWORKS, *FRAMEWORK_PACKAGES.get(framework, ())):
        digest.update(f"{package}=={_pinned(package, lock_of(framework))}".encode())
    return digest.hexdigest()[:16]


_PLACEHOLDER = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdfrgixe%]|\{[^{}]*\}")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes in ``tree``."""
    return {id(node.body[0].value) for node in _documented(tree)}


@functools.cache
def code_words(root: Path = ROOT) -> frozenset[str]:
    """Every piece of text rankguard's code (and the examples' shared fault code) can print.

    The string literals of :data:`CODE` and :data:`SHARED_EXAMPLE_CODE` but their
    docstrings, cut at format placeholders (``%s``, ``{}``) into pieces of at
    least :data:`MIN_WORDS` characters with a letter in them.
    """
    files = [p for d in CODE for p in sorted((root / d).rglob("*.py"))]
    files += [root / f for f in SHARED_EXAMPLE_CODE]
    words: set[str] = set()
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) in skip:
                    continue
                for piece in _PLACEHOLDER.split(node.value):
                    if len(piece.strip()) >= MIN_WORDS and re.search("[A-Za-z]", piece):
                        words.add(piece)
    return frozenset(words)


def quoted_words(lines: list[str], root: Path = ROOT) -> list[str]:
    """The words of the code (:func:`code_words`) that rankguard's lines among ``lines`` quote."""
    text = "\n".join(line for line in lines if " rankguard" in line)
    return sorted(word for word in code_words(root) if word in text)


# -- the runs -------------------------------------------------------------------------------


#: Where the examples write (``out/`` is git-ignored).
WORKDIR = "out/examples"
#: Composer's per-rank log files (in a folder that exists before the launcher opens them).
RANK_LOGS = "/tmp/rankguard-rank{rank}.err"


@dataclass(frozen=True)
class Example:
    """An example script with a ``--fault`` option and its launch command.

    The command runs the example in its framework's environment: ``.venv/bin/...``, or
    ``.venv-composer/bin/...`` for Composer, which lives in its own.

    Composer's launcher shows local rank 0's output only (and another rank's when that
    rank fails on its own); its command gets ``--stderr`` so every rank's log is kept.
    """

    script: str
    framework: str
    command: str
    faults: tuple[str, ...]


@dataclass(frozen=True)
class Run:
    """One recorded run: an example, a fault, with or without rankguard."""

    example: Example
    fault: str
    rankguard: bool

    @property
    def name(self) -> str:
        """File name of the recording, e.g. ``composer.uneven_eval.without.txt``."""
        return f"{self.example.framework}.{self.fault}.{'with' if self.rankguard else 'without'}"

    @property
    def command(self) -> str:
        """The command exactly as the docs show it (run from the repository root)."""
        fault = "" if self.fault == "none" else f" --fault {self.fault}"
        return f"{self.example.command}{fault}{'' if self.rankguard else ' --no-rankguard'}"

    @property
    def plain_command(self) -> str:
        """The command without the options that keep other ranks' logs (as the README has it)."""
        return self.command.replace(f" --stderr {RANK_LOGS}", "")


def examples() -> list[Example]:
    """Every example whose docstring has a healthy line, launched as that line says."""
    found = []
    known = faults()
    for path in sorted(EXAMPLES.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        healthy = (line.split(HEALTHY_MARK)[0] for line in doc.splitlines() if HEALTHY_MARK in line)
        command = next(healthy, "").strip()
        if not command:
            continue
        listed = {m.group(1) for m in re.finditer(r"^    (\w+)  ", doc, re.M)}
        offered = tuple(name for name in known if name == "none" or name in listed)
        if len(offered) < 2:
            raise SystemExit(f"{path.name}: its docstring lists none of the faults of faults.py")
        framework = framework_of(path.name)
        if command.startswith("composer "):  # keep every rank's log, not rank 0's alone
            launcher, script, args = command.partition(f"examples/{path.name}")
            command = f"{launcher}--stderr {RANK_LOGS} {script}{args}"
        venv = ".venv-composer" if framework == "composer" else ".venv"
        found.append(Example(path.name, framework, f"{venv}/bin/{command}", offered))
    order = list(FRAMEWORK_NAMES)
    return sorted(found, key=lambda e: order.index(e.framework) if e.framework in order else 99)


def faults() -> dict[str, str]:
    """``FAULTS`` of ``examples/faults.py``: name -> what it does."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import faults as module
    finally:
        sys.path.remove(str(EXAMPLES))
    return dict(module.FAULTS)


def runs() -> list[Run]:
    """Every run the catalogue quotes: each example and fault, with and without rankguard."""
    return [
        Run(example, fault, with_rankguard)
        for fault in faults()
        for example in examples()
        for with_rankguard in (True, False)
        if fault in example.faults and (with_rankguard or fault != "none")
    ]


# -- running and recording ------------------------------------------------------------------


def normalise(text: str) -> str:
    """Makes an output independent of the machine and the moment: paths, pids, hosts, timings."""
    text = text.replace(str(ROOT) + "/", "").replace(str(ROOT), ".")
    rules = [
        (r"/tmp/(?!rankguard-rank)[^\s'\")]+", "/tmp/..."),
        (r"\b(pid|PID|process) \d+", r"\1 N"),
        (r"\(pid: \d+\)", "(pid: N)"),
        (r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ", r"\1 DATE TIME PID "),
        (r"\b(localhost|\d+\.\d+\.\d+\.\d+)(\]?):\d+", r"\1\2:PORT"),
        (r"\.py:\d+", ".py:N"),
        (r", line \d+", ", line N"),
        (r"\b\d+\.\d+ s\b", "N.N s"),
        (r"\b(stuck|waiting) \d+ s\b", r"\1 N s"),
        (r"\b\d+(\.\d+)? [KMGT]?i?B(?= (is available )?\((MemAvailable|cgroup))", "N GiB"),
        (r"\b\d+% of step time", "N% of step time"),
        (r"\b\d+ slow steps in a row", "N slow steps in a row"),
        (r"\b[\d.]+ samples/s", "N samples/s"),
        (r"\b\d+(\.\d+)? ms\b", "N ms"),
        (r"\bscore \d\.\d+ <", "score N <"),
        (r"\d{4}-\d\d-\d\d[_ T]\d\d:\d\d:\d\d", "DATE TIME"),
    ]
    for pattern, replacement in rules:
        text = re.sub(pattern, replacement, text, flags=re.M)
    host = socket.gethostname()
    text = re.sub(rf"\b{re.escape(host)}\b", "HOST", text)
    return "\n".join(_realign(text.split("\n")))


_TABLE_HEAD = re.compile(r"^node {2,}ranks {2,}available {2,}")


def _realign(lines: list[str]) -> list[str]:
    """Re-pads the checkpoint plan's table, whose cells :func:`normalise` changed."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        if not _TABLE_HEAD.match(lines[i]):
            out.append(lines[i])
            i += 1
            continue
        rows = [re.split(r" {2,}", lines[i].strip())]
        i += 1
        while i < len(lines) and len(re.split(r" {2,}", lines[i].strip())) == len(rows[0]):
            rows.append(re.split(r" {2,}", lines[i].strip()))
            i += 1
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        out += [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
    return out


def _rank_logs() -> list[Path]:
    """Composer's log files of the other ranks (rank 0 writes to the console)."""
    folder, _, pattern = RANK_LOGS.rpartition("/")
    return sorted(Path(folder).glob(pattern.replace("{rank}", "*")))


def execute(run: Run, timeout_s: float) -> tuple[str, str]:
    """Runs ``run.command`` from the repository root; returns its output and how it ended."""
    started = time.monotonic()
    for path in _rank_logs():
        path.unlink()  # the launcher appends to these
    # A run's tree is killed at the timeout, and also on Ctrl-C or SIGTERM (:func:`finish`).
    [done] = finish([start(shlex.split(run.command), env=job_env(), cwd=ROOT)], timeout_s)
    output = done.stdout
    if done.timed_out:
        ended = f"still running after {timeout_s:g} s: stopped by the docs generator"
    else:
        ended = f"exit code {done.returncode}"
    log.info("%s: %s (%.0f s)", run.name, ended, time.monotonic() - started)
    for path in _rank_logs():
        output += f"\n$ cat {path}\n{path.read_text(encoding='utf-8', errors='replace')}"
    return output, ended


def record(run: Run, output: str, ended: str) -> Path:
    """Writes ``docs/outputs/<run>.txt`` and the words it quotes (:data:`WORDS`).

    The file holds a header (the command, :func:`example_digest`, how the run
    ended) and the normalised output.
    """
    OUTPUTS.mkdir(parents=True, exist_ok=True)
    path = OUTPUTS / f"{run.name}.txt"
    header = f"$ {run.command}\n# example {example_digest(run.example.script)}\n# {ended}\n"
    path.write_text(header + normalise(output).rstrip() + "\n", encoding="utf-8")
    remember_words(run)
    return path


def read_words() -> dict[str, list[str]]:
    """:data:`WORDS`: per recording, the words of the code it quotes."""
    return json.loads(WORDS.read_text(encoding="utf-8")) if WORDS.exists() else {}


def remember_words(run: Run) -> None:
    """Writes into :data:`WORDS` the words of the code that ``run``'s recording quotes."""
    recording = read_recording(run)
    if recording is None:
        return
    lines = recording.lines
    if records_hang_report(run):  # the report is quoted as well
        for path in sorted(HANG_REPORT.glob("*.txt")):
            lines = [*lines, *(f"rankguard {line}" for line in path.read_text().splitlines())]
    words = read_words()
    words[run.name] = quoted_words(lines)
    WORDS.write_text(json.dumps(dict(sorted(words.items())), indent=1) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class Recording:
    """A recorded output read back: the command, the example's digest, how it ended, the lines."""

    command: str
    digest: str
    ended: str
    lines: list[str]


def read_recording(run: Run) -> Recording | None:
    """The recording of ``run``, or ``None`` if there is none yet."""
    path = OUTPUTS / f"{run.name}.txt"
    if not path.exists():
        return None
    command, digest, ended, *lines = path.read_text(encoding="utf-8").splitlines()
    return Recording(command[2:], digest.removeprefix("# example "), ended[2:], lines)


def staleness(run: Run, root: Path = ROOT) -> str | None:
    """Why rerunning ``run`` could print something other than its recording, or ``None``.

    A recording is stale when there is none, when its command, its example's
    code or the frameworks' pinned versions changed (:func:`example_digest`), or
    when rankguard's lines in it quote words the code no longer has: a message
    reworded, cut short or extended; or when its tracebacks quote a file of the
    repository that is gone (a module moved or renamed). A change that leaves every quoted word in
    place (a renamed variable, a refactoring, a new message elsewhere) leaves the
    recording as it is; what the code does with the same words is checked by the
    tests that rerun examples and compare them with their recordings
    (:func:`says_otherwise`).

    Args:
        run: The run.
        root: The repository whose code is compared (a copy, in the tests).
    """
    recording = read_recording(run)
    if recording is None:
        return "not recorded"
    if recording.command != run.command:
        return f"recorded as {recording.command!r}"
    if recording.digest != example_digest(run.example.script):
        return f"examples/{run.example.script} or the pinned framework versions changed"
    gone = [w for w in read_words().get(run.name, []) if w not in code_words(root)]
    if gone:
        return "quotes words the code no longer has: " + "; ".join(repr(w) for w in gone)
    lines = recording.lines
    if records_hang_report(run):  # the report's stacks are quoted as well
        lines = [
            *lines,
            *(
                line
                for p in sorted(HANG_REPORT.glob("*.txt"))
                for line in p.read_text().splitlines()
            ),
        ]
    moved = sorted({path for path in quoted_files(lines) if not (ROOT / path).exists()})
    moved += sorted({name for name in quoted_modules(lines) if name not in module_files(root)})
    if moved:
        return "quotes files the repository no longer has: " + ", ".join(moved)
    return None


_TRACEBACK_FILE = re.compile(r'\bFile "([^"/<.][^"]*\.py)", line')


@functools.cache
def module_files(root: Path = ROOT) -> frozenset[str]:
    """The file names of rankguard's modules (``src/``), read once per repository."""
    return frozenset(path.name for path in (root / "src").rglob("*.py"))


#: A wait in an exchange names the rankguard module that called it, by file name.
_EXCHANGE_CALLER = re.compile(r"rankguard exchange, called from (\w+\.py):")


def quoted_modules(lines: list[str]) -> list[str]:
    """The file names of rankguard's modules a recording's hang reports quote."""
    return [m.group(1) for line in lines for m in _EXCHANGE_CALLER.finditer(line)]


def quoted_files(lines: list[str]) -> list[str]:
    """The repository's files a recording's tracebacks quote (paths relative to its root).

    Installed packages (``.venv/...``) and absolute paths are left out: only
    rankguard's own files and the examples' can move with a change here.
    """
    return [m.group(1) for line in lines if (m := _TRACEBACK_FILE.search(line))]


def stale(run: Run) -> bool:
    """Whether ``run`` needs rerunning (see :func:`staleness`)."""
    return staleness(run) is not None


def says_otherwise(run: Run, output: str, workdir: Path | None = None) -> list[str]:
    """How a fresh run of ``run`` differs from its recording in rankguard's warnings and errors.

    For every rank whose log ``output`` holds (a launcher may show rank 0's
    only), the rankguard WARNING and ERROR lines must be those the recording
    holds for that rank, after :func:`normalise`.

    Args:
        run: The recorded run.
        output: What the fresh run printed.
        workdir: Where the fresh run wrote (its ``--workdir``); read as the
            recording's ``out/examples``.
    """
    recording = read_recording(run)
    if recording is None:
        return ["not recorded"]
    if workdir is not None:
        output = output.replace(str(workdir), WORKDIR)
    fresh, recorded = _warned(normalise(output).splitlines()), _warned(recording.lines)
    differences = []
    for rank, lines in sorted(fresh.items()):
        before = recorded.get(rank, set())
        differences += [f"not in the recording: {line}" for line in sorted(lines - before)]
        differences += [f"recorded, not said now: {line}" for line in sorted(before - lines)]
    return differences


#: Values that differ from run to run by design: the content hashes of an unseeded split.
_RANDOM = re.compile(r"\bhash [0-9a-f]{8}\b|'[0-9a-f]{16}'")


def _warned(lines: list[str]) -> dict[str, set[str]]:
    """Per rank (``[rank N``), rankguard's WARNING and ERROR messages among ``lines``.

    A message is its logged line with the continuation lines that follow it (a
    hang report's per-rank lines). Content hashes, which differ from run to run
    where the fault is randomness, are masked.
    """
    by_rank: dict[str, set[str]] = {}
    message: list[str] = []
    for line in [*lines, "[rank end]"]:
        if message and line.strip() and not _NOT_CONTINUATION.match(line):
            message.append(line)
            continue
        if message:
            by_rank.setdefault(message[0].split("]")[0], set()).add(
                _RANDOM.sub("#", "\n".join(message))
            )
            message = []
        match = _LOGGED.match(line)
        if match and match.group(1) != "INFO" and match.group(2).startswith("rankguard"):
            message = [line]
    return by_rank


def records_hang_report(run: Run) -> bool:
    """Whether ``run``'s hang report is the one the docs show (:data:`HANG_REPORT`)."""
    return run.fault == "post_eval_hang" and run.rankguard and run.example.framework == "composer"


def record_hang_report(report_dir: Path) -> None:
    """Copies the ``post_eval_hang`` run's report into ``docs/hang-report`` and draws it.

    The report is ``report_dir`` itself or, where the watchdog keeps one report per
    restart attempt, its first subfolder that holds one.
    """
    folders = sorted({p.parent for p in report_dir.rglob("rank*.txt")})
    if not folders:
        raise SystemExit(f"the post_eval_hang run left no report in {report_dir}")
    if HANG_REPORT.exists():
        shutil.rmtree(HANG_REPORT)
    HANG_REPORT.mkdir(parents=True)
    for path in sorted(folders[0].iterdir()):
        if path.suffix in (".txt", ".jsonl"):
            (HANG_REPORT / path.name).write_text(normalise(path.read_text()), encoding="utf-8")
    command = [str(ROOT / ".venv" / "bin" / "rankguard"), "report", str(HANG_REPORT)]
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT)


# -- the prose of each fault ----------------------------------------------------------------


def disagreement(run: Run) -> str | None:
    """How ``run``'s recording contradicts its fault's prose, or ``None`` where it agrees.

    A run with rankguard must log the prose's ``quote`` (``quote_<framework>``, e.g.
    ``quote_lightning``, where one example says it differently); a healthy run and a run
    without rankguard must log no rankguard warning or error. Checked by
    ``tests/docs/test_docs.py``; the generator says it at once, so a detection that a
    busy machine delayed past the example's end can be rerun (``--only``).
    """
    recording = read_recording(run)
    if recording is None:
        return "not recorded"
    if recording.ended == "exit code 2":
        return "a usage error"
    logged = "\n".join(line for line in recording.lines if " rankguard" in line)
    if not run.rankguard or run.fault == "none":
        if "WARNING rankguard" in logged or "ERROR rankguard" in logged:
            return "a rankguard warning or error where none belongs"
        return None
    fields = read_prose(run.fault).fields
    quote = fields.get(f"quote_{run.example.framework}", fields.get("quote"))
    if quote and quote not in logged:
        return f"no rankguard line says {quote!r}"
    return None


@dataclass(frozen=True)
class Prose:
    """``docs/faults/<fault>.md``: its front matter (``key: value`` lines) and its text.

    A new ``--fault`` in ``examples/faults.py`` needs this file (``tests/docs/test_docs.py``
    fails without it). Front matter keys:

    * ``title``, ``symptom`` (without rankguard), ``says`` (what rankguard says),
      ``when``: the failure tables' cells (required);
    * ``quote``: text every run with rankguard must log (``quote_<framework>``
      for one example, e.g. ``quote_lightning``);
    * ``show_info: yes``: the catalogue quotes rankguard's INFO lines too;
    * ``stop_without_after_s``: when to stop a run without rankguard (default
      :data:`STOP_WITHOUT_AFTER_S`);
    * ``readme: no``: left out of the README's table.

    The text after the front matter is the catalogue's prose, in markdown, with
    links relative to ``docs/``.
    """

    fault: str
    fields: dict[str, str]
    text: str


def read_prose(fault: str) -> Prose:
    """The prose of ``fault``; empty when its file is missing (``test_docs.py`` says so)."""
    path = PROSE / f"{fault}.md"
    if not path.exists():
        return Prose(fault, {}, "")
    content = path.read_text(encoding="utf-8")
    fields: dict[str, str] = {}
    if content.startswith("---\n"):
        head, _, content = content[4:].partition("\n---\n")
        for line in head.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    return Prose(fault, fields, content.strip())


# -- docstrings to markdown ------------------------------------------------------------------

GENERATED = "<!-- Generated by `make docs` ({source}); edit the source, not this page. -->"
_SECTION = re.compile(r"^(Args|Attributes|Example|Examples|Returns|Raises|Note)(::|:)$")


def anchor(heading: str) -> str:
    """The link anchor GitHub gives a heading (as the README link check computes it)."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def rst_inline(text: str) -> str:
    """Docstring markup as markdown: ````x```` and ``:role:`x``` become ```x```."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: f"`{m.group(1).split('.')[-1]}`", text)
    text = re.sub(r"(\[\d+\])_", r"\1", text)  # footnote references
    text = re.sub(r"^\.\. (\[\d+\])", r"\1", text)  # footnotes
    return text.replace("``", "`")


def rst_table(lines: list[str]) -> list[str]:
    """A simple reST table (``===`` borders) as a markdown table; wrapped cells are joined."""
    border = lines[0]
    spans = [(m.start(), m.end()) for m in re.finditer(r"=+", border)]
    rows: list[list[str]] = []
    for line in lines[1:]:
        if set(line.strip()) <= {"=", " "}:
            continue
        cells = [
            line[a : (spans[i + 1][0] if i + 1 < len(spans) else None)].strip()
            for i, (a, _) in enumerate(spans)
        ]
        if rows and not cells[0]:
            rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cells, strict=True)]
        else:
            rows.append(cells)
    head, *body = rows
    out = ["| " + " | ".join(rst_inline(c) for c in head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(rst_inline(c) for c in row) + " |" for row in body]


def rst_text(text: str) -> str:
    """Docstring prose as markdown: tables, ``Example::`` blocks, inline markup."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"^\s*=+( +=+)+\s*$", line):
            j = i + 1
            borders = 1
            while j < len(lines) and borders < 3:
                borders += bool(re.match(r"^\s*=+( +=+)+\s*$", lines[j]))
                j += 1
            out += rst_table([ln.strip() if k == 0 else ln for k, ln in enumerate(lines[i:j])])
            i = j
            continue
        if line.rstrip().endswith("::"):
            out.append(rst_inline(line.rstrip()[:-1]))
            block = []
            i += 1
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith("    ")):
                block.append(lines[i][4:])
                i += 1
            out += ["", "```python", *"\n".join(block).strip("\n").splitlines(), "```"]
            continue
        out.append(rst_inline(line))
        i += 1
    return "\n".join(out)


@dataclass(frozen=True)
class Docstring:
    """A Google-style docstring: its summary, its prose, its ``Args`` and other sections."""

    summary: str
    prose: str
    args: dict[str, str]
    sections: dict[str, str]


def parse_docstring(doc: str) -> Docstring:
    """Splits a Google-style docstring into its summary, prose, ``Args`` and sections."""
    summary, _, rest = doc.strip().partition("\n")
    prose: list[str] = []
    sections: dict[str, list[str]] = {}
    current: list[str] = prose
    for line in rest.splitlines():
        match = _SECTION.match(line)
        if match:
            current = sections.setdefault(match.group(1), [])
            if match.group(2) == "::":  # a literal block follows
                current.append("::")
            continue
        if current is not prose and line and not line.startswith(" "):
            current = prose  # back to prose after a section
        current.append(line)
    args: dict[str, str] = {}
    name = None
    for line in sections.pop("Args", []):
        match = re.match(r"^    (\*{0,2}\w+): ?(.*)$", line)
        if match:
            name = match.group(1)
            args[name] = match.group(2)
        elif name and line.strip():
            args[name] += " " + line.strip()
    text = {k: "\n".join(v).strip() for k, v in sections.items()}
    return Docstring(summary.strip(), "\n".join(prose).strip(), args, text)


# -- the reference --------------------------------------------------------------------------

ERRORS_NOT_RAISED = ("RankGuardError", "RanksMissingError")


def _module_names(module: object) -> tuple[set[str], set[str]]:
    """Names a module's code uses (outside ``except`` clauses), and its string constants."""
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    caught = {
        id(n)
        for handler in ast.walk(tree)
        if isinstance(handler, ast.ExceptHandler) and handler.type is not None
        for n in ast.walk(handler.type)
    }
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in caught}
    strings = {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    return names, strings


def _imported_names(module: object) -> set[str]:
    """The names a module imports from others (``from x import NAME``)."""
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def _framework_defaults() -> dict[str, dict[str, dict[str, object]]]:
    """Per guard, per integration: settings whose ``RankGuard()`` value differs from the core's."""
    import importlib
    import inspect

    import rankguard

    found: dict[str, dict[str, dict[str, object]]] = {}
    for integration in rankguard.integrations_available():
        try:
            module = importlib.import_module(f"rankguard.integrations.{integration}")
            guards = module.RankGuard().runner.guards
        except Exception:  # a framework not installed, or another adapter shape
            continue
        for guard in guards:
            for param in inspect.signature(type(guard).__init__).parameters.values():
                if param.kind is not param.KEYWORD_ONLY or not hasattr(guard, param.name):
                    continue
                value = getattr(guard, param.name)
                if value != param.default and param.default is not None:
                    found.setdefault(guard.name, {}).setdefault(integration, {})[param.name] = value
    return found


def _value(value: object) -> str:
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def render_guard(name: str, cls: type, framework_defaults: dict) -> list[str]:
    """One guard's section of the reference."""
    import importlib
    import inspect

    from rankguard.callbacks.core import errors
    from rankguard.callbacks.core.events import Event

    doc = parse_docstring(inspect.getdoc(cls) or "")
    module = importlib.import_module(cls.__module__)
    names, strings = _module_names(module)
    params = [
        p for p in inspect.signature(cls.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY
    ]
    out = [f"### {cls.__name__}", "", rst_inline(doc.summary), ""]
    out += [
        f"In `RankGuard(...)`: `{name}={{...}}` (or `{name}=False` to leave it out). On its own:",
        f"`{cls.__name__}(...)` from any integration, or `rankguard.callbacks.{cls.__name__}`",
        "for a framework-free loop.",
        "",
    ]
    for text in (explained(module), rst_text(doc.prose)):
        if text:
            out += [text, ""]
    out += ["| setting | default | type | what it does |", "|---|---|---|---|"]
    for p in params:
        annotation = str(p.annotation).replace("|", "or")
        meaning = rst_inline(doc.args.get(p.name, "")).replace("|", "or")
        out.append(f"| `{p.name}` | {_value(p.default)} | {annotation} | {meaning} |")
    out.append("")
    for integration, values in sorted(framework_defaults.get(name, {}).items()):
        shown = ", ".join(f"`{k}={v!r}`" for k, v in values.items())
        out += [f"Under `rankguard.integrations.{integration}`, `RankGuard()` uses {shown}.", ""]
    events = [
        e.value.replace("_", " ")
        for e in Event
        if callable(getattr(cls, f"on_{e.value}", None)) or e in cls.step_events
    ]
    raised = sorted(n for n in errors.__all__ if n in names and n not in ERRORS_NOT_RAISED)
    exits = names | _imported_names(module)  # a guard may only import its codes (__all__)
    codes = sorted(f"{getattr(module, n)} (`{n}`)" for n in exits if n.endswith("_EXIT_CODE"))
    metrics = sorted(s for s in strings if re.fullmatch(r"rankguard/[a-z0-9_/]+", s))
    files = [f"`{p.name}`" for p in params if p.name.endswith("_dir")]
    out += [
        f"- **Events:** {', '.join(events)} ([where each comes from](#events))",
        f"- **Errors:** {', '.join(f'`{e}`' for e in raised) or 'none'}"
        + (f"; exit code {', '.join(codes)}" if codes else ""),
        f"- **Metrics:** {', '.join(f'`{m}`' for m in metrics) or 'none'}",
        "- **Files:** "
        + (
            f"written to {', '.join(files)} ([hang report files](#hang-report-files))"
            if files
            else "none"
        ),
    ]
    for section in ("Attributes", "Example", "Examples"):
        if section in doc.sections:
            body = doc.sections[section]
            if body.startswith("::"):
                code = textwrap_dedent(body[2:])
                out += ["", f"{section}:", "", "```python", code, "```"]
            else:
                out += ["", f"{section}:", "", rst_text(textwrap_dedent(body))]
    return [*out, ""]


#: A module docstring's pointer to the docs page section that explains the module.
_POINTER = re.compile(r"^See docs/([\w.-]+\.md)#([\w-]+)\.$", re.M)


def page_section(page: str, fragment: str) -> str:
    """The body of the section of ``docs/<page>`` whose heading's anchor is ``fragment``.

    Up to the next heading of its level or above; its links within the page are made
    links to the page, so the text reads the same quoted in another page of ``docs/``.
    """
    lines = (DOCS / page).read_text(encoding="utf-8").splitlines()
    fenced = False
    body: list[str] | None = None
    level = 0
    for line in lines:
        fenced ^= line.startswith("```")
        heading = None if fenced else re.match(r"^(#+) (.*)$", line)
        if heading and body is not None and len(heading.group(1)) <= level:
            break
        if body is not None:
            body.append(line)
        elif heading and anchor(heading.group(2)) == fragment:
            body, level = [], len(heading.group(1))
    if body is None:
        raise ValueError(f"docs/{page} has no heading #{fragment}")
    return "\n".join(body).strip().replace("](#", f"]({page}#")


def explained(module: object) -> str:
    """How ``module`` works, as markdown: the docs page section its docstring points to.

    A module docstring of a few lines ends with ``See docs/<page>.md#<anchor>.``; the
    reference quotes that section. A docstring without a pointer gives its own prose.
    """
    import inspect

    doc = inspect.getdoc(module) or ""
    pointer = _POINTER.search(doc)
    if pointer:
        return page_section(*pointer.groups())
    return rst_text(parse_docstring(doc).prose)


def textwrap_dedent(text: str) -> str:
    """``textwrap.dedent`` of a docstring section, without its surrounding blank lines."""
    import textwrap

    return textwrap.dedent(text).strip("\n")


def _bundle_lines() -> list[str]:
    """``RankGuard``'s signature, one argument a line, as every integration declares it."""
    import inspect

    from rankguard.integrations._api import RankGuardSettings

    lines = ["RankGuard("]
    star = False
    for param in list(inspect.signature(RankGuardSettings.__init__).parameters.values())[1:]:
        if param.kind is param.KEYWORD_ONLY and not star:
            lines.append("    *,")
            star = True
        lines.append(f"    {param.name}={param.default!r},")
    return [*lines, ")"]


def render_reference() -> str:
    """``docs/reference.md``: ``RankGuard``, every registered guard, events, files, errors."""
    import inspect

    from rankguard.callbacks.core import errors, events
    from rankguard.callbacks.hang import report as hang_report
    from rankguard.callbacks.registry import GUARDS

    defaults = _framework_defaults()
    out = [
        GENERATED.format(
            source="docs/generate.py, from src/rankguard/callbacks/registry.py and the guards"
        ),
        "",
        "# rankguard reference",
        "",
        "Every guard, every setting and its default, the events each reacts to, the errors,",
        "metric keys and files. [The failure catalogue](failures.md) shows them at work.",
        "",
        "## RankGuard",
        "",
        "Every integration (`rankguard.integrations.composer`, `.lightning`, ...) exports",
        "`RankGuard`, every guard below in one callback with sound defaults, and one",
        "callback per guard under the guard's name. Constructor arguments are keyword",
        "arguments of plain values, so YAML configs build them (llm-foundry's",
        "`callbacks:` section, LightningCLI's `init_args`, see `examples/*.yaml`).",
        "",
        "```python",
        *_bundle_lines(),
        "```",
        "",
        "- `exchange_timeout_s`: how long a cross-rank check waits for every rank before",
        "  naming the ones that did not arrive (seconds; plus 5 ms per rank in the world).",
        "- `<guard name>`: a dict of that guard's settings, `True` for its defaults, or",
        "  `False` to leave it out, e.g.",
        '  `RankGuard(hang_watchdog={"timeout_s": 300}, data_stall_monitor=False)`.',
        "",
        "An unknown name raises `ValueError` listing the valid ones, with the closest match.",
        "A guard that raises logs its error on every rank first (logger",
        "`rankguard.callbacks.guard`, ERROR) and raises it on every rank at the same point;",
        'with `on_violation="warn"` it logs it as a warning and training goes on.',
        "",
        "## Guards",
        "",
        "In run order (root causes first):",
        "",
    ]
    out += [
        f"- [{cls.__name__}](#{anchor(cls.__name__)}): {inspect.getdoc(cls).splitlines()[0]}"
        for cls in GUARDS.values()
    ]
    out.append("")
    framework_defaults = defaults
    for name, cls in GUARDS.items():
        out += render_guard(name, cls, framework_defaults)
    out += ["## Events", "", explained(events), ""]
    report_doc = inspect.getdoc(hang_report) or ""
    out += ["## Hang report files", "", rst_text(report_doc.split("\n", 1)[1].strip()), ""]
    out += ["## Errors", "", rst_text(inspect.getdoc(errors).split("\n", 1)[1].strip()), ""]
    for name in errors.__all__:
        cls = getattr(errors, name)
        parents = ", ".join(f"`{b.__name__}`" for b in cls.__bases__)
        summary = rst_inline((inspect.getdoc(cls) or "").splitlines()[0])
        out.append(f"- `{name}` ({parents}): {summary}")
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).rstrip() + "\n"


# -- the failure catalogue and the README's table -------------------------------------------

#: Log lines quoted from a run: rankguard's and the example's own.
_LOGGED = re.compile(r"^\[rank \d+\] (INFO|WARNING|ERROR) (rankguard[\w.]*|example): ")
#: What a launcher says about how a rank ended: Composer's, torchrun's failure table, an abort.
_LAUNCHER = re.compile(
    r"^(ERROR:composer\.cli\.launcher:)?Global rank \d+ \(PID N\) exited with"
    r"|^  (rank|exitcode) +: |^terminate called after|^  what\(\): "
)
_EXCEPTION = re.compile(r"^(\[rank\d+\]: )?([A-Za-z_][\w.]*)(Error|Exception): ")
_NOT_CONTINUATION = re.compile(
    r"^(\[rank|Traceback|  |During handling|The above exception|Global rank|ERROR:|WARNING:|"
    r"Waiting up to|/|\w+Warning|[IWEF] DATE TIME PID )"
)
#: How the catalogue names each example, by the first word of its file name.
FRAMEWORK_NAMES = {
    "composer": "Composer",
    "lightning": "Lightning",
    "torch": "Hand-written loop",
    "hf": "Hugging Face Trainer",
    "olmo": "OLMo-core Trainer",
}
README_BEGIN = "<!-- failures: generated by make docs from docs/faults/*.md -->"
README_END = "<!-- end of failures -->"


def quoted(recording: Recording, info: bool) -> list[str]:
    """The lines of a run the catalogue quotes: rankguard's and the example's logs, how it ended.

    Args:
        recording: The recorded run.
        info: Whether rankguard's INFO lines are quoted too (else WARNING and ERROR).
    """
    out: list[str] = []
    following = False  # continuation lines of a quoted multi-line rankguard message
    for line in recording.lines:
        if line.startswith("$ cat "):  # another rank's log file follows
            out.append(line)
            following = False
            continue
        match = _LOGGED.match(line)
        if match:
            keep = match.group(2) == "example" or info or match.group(1) != "INFO"
            following = keep and match.group(2).startswith("rankguard")
            if keep:
                out.append(line)
        elif following and line.strip() and not _NOT_CONTINUATION.match(line):
            out.append(line)
        else:
            following = False
            exception = _EXCEPTION.match(line)
            if _LAUNCHER.match(line) or (exception and "rankguard." not in exception.group(2)):
                out.append(line)
    # A rank that failed on its own is printed by the launcher and is in its log file too.
    seen: set[str] = set()
    unique = [line for line in out if line.startswith("$ ") or not (line in seen or seen.add(line))]
    return [
        line
        for i, line in enumerate(unique)
        if not line.startswith("$ cat ")
        or (i + 1 < len(unique) and not unique[i + 1].startswith("$"))
    ]


def _name(example: Example) -> str:
    return FRAMEWORK_NAMES.get(example.framework, example.framework.title())


def _framework(run: Run) -> str:
    return _name(run.example)


def render_failures() -> str:
    """``docs/failures.md``: every fault, its prose, and what each example printed."""
    all_runs = runs()
    out = [
        GENERATED.format(source="docs/generate.py, from docs/faults/*.md and docs/outputs/"),
        "",
        "# The failures rankguard catches",
        "",
        "Each failure can be injected into a real 2-rank CPU training with `--fault NAME`",
        "in each example that offers it: "
        + ", ".join(f"[{e.script}](../examples/{e.script}) ({_name(e)})" for e in examples())
        + ". `--no-rankguard` shows the symptom, no `--fault` is a healthy run.",
        "Run the commands from the repository root after `make demo` (which creates",
        "`.venv`). The output below is from those exact commands, trimmed to rankguard's",
        "and the example's own log lines and how the run ended; the full recordings are",
        "in [outputs/](outputs/). Paths, pids, host names and timings are normalised",
        "(`N`, `HOST`).",
        "",
        "Composer's launcher shows local rank 0's output, and another rank's only when",
        "that rank failed on its own: the Composer commands keep every rank's log in",
        f"`{RANK_LOGS}` (`--stderr`), shown after `cat`. Checkpoints and hang",
        "reports go to `out/examples/` (git-ignored; `--workdir` to change). A run",
        f"without rankguard that hangs is stopped after {STOP_WITHOUT_AFTER_S} s, as its heading",
        "says (the examples train for about a second).",
        "",
        "| failure | `--fault` | without rankguard | rankguard says | when |",
        "|---|---|---|---|---|",
    ]
    for fault in faults():
        prose = read_prose(fault)
        title = prose.fields.get("title", fault)
        out.append(
            f"| [{title}](#{anchor(title)}) | `{fault}` | {prose.fields.get('symptom', '')} | "
            f"{prose.fields.get('says', '')} | {prose.fields.get('when', '')} |"
        )
    out.append("")
    for fault, does in faults().items():
        prose = read_prose(fault)
        info = prose.fields.get("show_info", "no") == "yes"
        default = " (the default)" if fault == "none" else ""
        title = prose.fields.get("title", fault)
        out += [f"## {title}", "", f"`--fault {fault}`{default}: {does}.", ""]
        if prose.text:
            out += [prose.text, ""]
        for run in (r for r in all_runs if r.fault == fault):
            recording = read_recording(run)
            if recording is None:
                out += [f"`{run.command}`: not recorded yet (`make docs`).", ""]
                continue
            who = "with rankguard" if run.rankguard else "without rankguard"
            lines = quoted(recording, info) or ["(no line from rankguard or the example)"]
            out += [
                f"**{_framework(run)}, {who}** ({recording.ended}):",
                "",
                "```console",
                f"$ {run.command}",
                *lines,
                "```",
                "",
            ]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).rstrip() + "\n"


def render_readme_table(readme: str) -> str:
    """``README.md`` with its failure table (between the markers) rendered from the prose."""
    rows = [
        "| failure | without rankguard | rankguard says | when |",
        "|---|---|---|---|",
    ]
    for fault in faults():
        prose = read_prose(fault)
        if fault == "none" or prose.fields.get("readme", "yes") == "no":
            continue
        title = prose.fields.get("title", fault)
        rows.append(
            f"| [{title}](docs/failures.md#{anchor(title)}) | "
            f"{prose.fields.get('symptom', '')} | {prose.fields.get('says', '')} | "
            f"{prose.fields.get('when', '')} |"
        )
    head, begin, rest = readme.partition(README_BEGIN)
    _, end, tail = rest.partition(README_END)
    if not begin or not end:
        raise SystemExit(f"README.md needs the lines {README_BEGIN!r} and {README_END!r}")
    return f"{head}{README_BEGIN}\n" + "\n".join(rows) + f"\n{README_END}{tail}"


EXIT_BEGIN = "<!-- exit codes: generated by make docs from hang/status.py EXIT_CODES -->"
EXIT_END = "<!-- end of exit codes -->"
#: What a launcher does with each exit code rankguard ends a job with.
EXIT_ADVICE = {
    70: "do not restart: it replays; fix the code the report names",
    75: "restart (torchrun `--max-restarts`, a scheduler's requeue): the job resumes from "
    "its checkpoint",
}


def render_exit_codes(readme: str) -> str:
    """``README.md`` with its exit-code table rendered from the one table the code reads."""
    from rankguard.callbacks.hang.status import EXIT_CODES, EXIT_MEANINGS

    rows = ["| exit code | every rank ends with it when | a launcher should |", "|---|---|---|"]
    for code in sorted({c for c in EXIT_CODES.values() if c is not None}):
        ends = "; ".join(EXIT_MEANINGS[k] for k, c in EXIT_CODES.items() if c == code)
        rows.append(f"| **{code}** | {ends} | {EXIT_ADVICE[code]} |")
    head, begin, rest = readme.partition(EXIT_BEGIN)
    _, end, tail = rest.partition(EXIT_END)
    if not begin or not end:
        raise SystemExit(f"README.md needs the lines {EXIT_BEGIN!r} and {EXIT_END!r}")
    return f"{head}{EXIT_BEGIN}\n" + "\n".join(rows) + f"\n{EXIT_END}{tail}"


def renormalise_recordings() -> None:
    """Applies the current :func:`normalise` to every recording (idempotent)."""
    for path in sorted(OUTPUTS.glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        if normalise(text) != text:
            path.write_text(normalise(text), encoding="utf-8")


def render_all() -> dict[Path, str]:
    """Every generated page, by path."""
    readme = ROOT / "README.md"
    return {
        DOCS / "reference.md": render_reference(),
        DOCS / "failures.md": render_failures(),
        readme: render_exit_codes(render_readme_table(readme.read_text(encoding="utf-8"))),
    }


def run_stale(force: bool, only: str | None = None) -> int:
    """Runs every run whose recording is stale (all with ``force``); returns how many ran.

    Args:
        force: Rerun every run, stale or not.
        only: Only the runs whose :attr:`Run.name` holds these whole dot-separated parts
            (``post_eval_hang.with`` is not ``post_eval_hang.without``).
    """
    part = f".{(only or '').strip('.')}." if only else "."
    todo = [run for run in runs() if (force or stale(run)) and part in f".{run.name}."]
    for i, run in enumerate(todo, 1):
        log.info("[%d/%d] %s", i, len(todo), run.command)
        reports = ROOT / "out" / "examples" / "rankguard_reports"
        shutil.rmtree(reports, ignore_errors=True)
        prose = read_prose(run.fault)
        without = prose.fields.get("stop_without_after_s", STOP_WITHOUT_AFTER_S)
        output, ended = execute(run, float(RUN_TIMEOUT_S if run.rankguard else without))
        if records_hang_report(run):  # before record(), which reads its words too
            record_hang_report(reports)
        record(run, output, ended)
        problem = disagreement(run)
        if problem:
            log.warning("%s: %s (rerun: --only %s --force)", run.name, problem, run.name)
    return len(todo)


def main(argv: list[str] | None = None) -> int:
    """Regenerates the docs; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rerun every example run")
    parser.add_argument("--list", action="store_true", help="list the runs, run nothing")
    parser.add_argument(
        "--only",
        metavar="TEXT",
        help="run (if stale, or with --force) only the runs whose file name holds the whole "
        "dot-separated parts TEXT, "
        "e.g. torch.drop_last or .with",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the run in progress too
    if args.list:
        for run in runs():
            why = staleness(run)
            sys.stdout.write(
                f"{'stale' if why else 'fresh'}  {run.command}{f'  ({why})' if why else ''}\n"
            )
        return 0
    started = time.monotonic()
    ran = run_stale(args.force, args.only)
    renormalise_recordings()
    for path, text in render_all().items():
        path.write_text(text, encoding="utf-8")
        log.info("wrote %s", path.relative_to(ROOT))
    log.info("%d example runs in %.0f s", ran, time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
