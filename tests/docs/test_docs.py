"""The docs cannot drift: pages match the code, quoted outputs come from it, commands work.

Nothing here runs an example: ``make docs`` does (``docs/generate.py``). These
tests only compare what it recorded and rendered with what it would record and
render now, and run the documented commands that finish in seconds.
"""

from __future__ import annotations

import inspect
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from rankguard.callbacks.registry import GUARDS
from tests.generator import generate

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
RUN_AGAIN = "run `make docs` (it reruns only the stale example runs, about 20 s each)"


def _section(page: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    level = heading.split(" ")[0]
    start = page.index(f"\n{heading}\n")
    end = re.search(rf"\n#{{1,{len(level)}}} ", page[start + 1 :])
    return page[start : start + 1 + end.start()] if end else page[start:]


def test_every_setting_of_every_registered_guard_is_in_the_reference():
    reference = (DOCS / "reference.md").read_text()
    for cls in GUARDS.values():
        section = _section(reference, f"### {cls.__name__}")
        params = inspect.signature(cls.__init__).parameters.values()
        for param in (p for p in params if p.kind is p.KEYWORD_ONLY):
            assert f"| `{param.name}` | " in section, f"{cls.__name__}.{param.name}: {RUN_AGAIN}"


def test_reference_is_rendered_from_the_current_guards():
    assert (DOCS / "reference.md").read_text() == generate.render_reference(), RUN_AGAIN


def test_no_recording_quotes_words_the_code_no_longer_has():
    stale = [f"{run.name}: {why}" for run in generate.runs() if (why := generate.staleness(run))]
    assert not stale, f"{len(stale)} recordings are stale: {RUN_AGAIN}:\n" + "\n".join(stale)


DROP_LAST = "src/rankguard/callbacks/batches/drop_last_guard.py"


#: The guard whose code the two tests below edit in a copy.
DROP_LAST = "src/rankguard/callbacks/batches/drop_last_guard.py"


def _copy_of_the_code(tmp_path: Path) -> Path:
    for folder in generate.CODE:
        shutil.copytree(ROOT / folder, tmp_path / folder)
    for file in generate.SHARED_EXAMPLE_CODE:
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / file, tmp_path / file)
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path.name} no longer holds {old!r}: pick another line"
    path.write_text(text.replace(old, new))


def test_a_change_that_keeps_every_message_leaves_every_recording_fresh(tmp_path):
    root = _copy_of_the_code(tmp_path)
    guard = root / DROP_LAST  # a comment-free line: the variable's name only
    _edit(guard, 'lines = " | ".join(', 'described = " | ".join(')
    _edit(guard, "between ranks: {lines}", "between ranks: {described}")
    assert [run.name for run in generate.runs() if generate.staleness(run, root)] == []


def test_a_reworded_message_makes_exactly_the_recordings_that_quote_it_stale(tmp_path):
    root = _copy_of_the_code(tmp_path)
    _edit(root / DROP_LAST, "Loader settings differ", "Loader settings vary")
    stale = {run.name: generate.staleness(run, root) for run in generate.runs()}
    stale = {name: why for name, why in stale.items() if why}
    quoting = {
        run.name
        for run in generate.runs()
        if run.rankguard
        and any(
            "Loader settings differ between ranks" in line
            for line in generate.read_recording(run).lines
        )
    }
    assert set(stale) == quoting and "composer.drop_last.with" in quoting
    assert all("'Loader settings differ between ranks: '" in why for why in stale.values())


def test_catalogue_and_readme_table_are_rendered_from_the_recordings_and_prose():
    assert (DOCS / "failures.md").read_text() == generate.render_failures(), RUN_AGAIN
    readme = (ROOT / "README.md").read_text()
    assert readme == generate.render_readme_table(readme), RUN_AGAIN


def test_readme_exit_code_table_is_the_one_the_code_reads():
    from rankguard.callbacks.hang.status import EXIT_CODES, EXIT_MEANINGS

    assert set(EXIT_MEANINGS) == set(EXIT_CODES)
    readme = (ROOT / "README.md").read_text()
    assert readme == generate.render_exit_codes(readme), RUN_AGAIN
    assert "| **70** | a proven deadlock" in readme and "| **75** | a rank stalled" in readme


def test_every_fault_has_prose_and_every_run_with_rankguard_says_what_the_tables_say():
    for fault in generate.faults():
        prose = generate.read_prose(fault)
        missing = {"title", "symptom", "says", "when"} - set(prose.fields)
        assert not missing, f"docs/faults/{fault}.md lacks {sorted(missing)}"
    runs = generate.runs()
    problems = [f"{r.command}: {p}" for r in runs if (p := generate.disagreement(r))]
    assert not problems, "\n".join([*problems, RUN_AGAIN])


def _anchors(text: str) -> set[str]:
    return {generate.anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve_to_files_and_headings(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"https?://", target):
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target}"
        if fragment:
            assert fragment in _anchors(linked.read_text()), f"{page.name}: {target}"


def test_readme_reads_in_five_minutes():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    assert not [line for line in lines if "2-core machine" in line or "host vm" in line]


def _documented_commands(langs: str = "bash|console") -> list[str]:
    """Every command in a ``bash`` block, or after ``$`` in a ``console`` block, of the docs."""
    commands = []
    for page in PAGES:
        for lang, block in re.findall(rf"```({langs})\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", "").splitlines():  # continuation lines joined
                if lang == "console" and not line.startswith("$ "):
                    continue
                command = line.removeprefix("$ ").split("  #")[0].strip()
                if command:
                    commands.append(command)
    return sorted(set(commands))


#: Commands that take minutes or rewrite the lock: run by ``make docs`` or by hand.
LONG = re.compile(r"^make (demo|test|check|docs|bench|lock)$|^pip install ")


def _recorded() -> set[str]:
    """The example runs ``make docs`` records, as the catalogue and the README show them."""
    runs = generate.runs()
    return {run.command for run in runs} | {run.plain_command for run in runs}


def test_every_example_run_in_the_docs_is_one_make_docs_records():
    recorded = _recorded()
    for command in _documented_commands():
        if "examples/" in command and "_train.py" in command:
            assert command in recorded, f"not run by make docs: {command}"


#: Example scripts whose documented runs finish in seconds (they import torch and
#: rankguard only), so the quick-command test runs them as written too; the other
#: examples' runs are ``make docs``'s (and ``tests/docs/test_examples.py``'s).
QUICK_EXAMPLES = ("examples/torch_loop.py",)


def _quick_commands() -> list[str]:
    recorded = _recorded()
    examples = [  # the ones the docs tell you to run; their transcripts are make docs's
        c for c in _documented_commands("bash") if any(f" {s}" in c for s in QUICK_EXAMPLES)
    ]
    return examples + [
        c
        for c in _documented_commands()
        if c not in recorded
        and not LONG.match(c)
        and not c.startswith("cat /tmp/rankguard-")
        and not _names_your_own_script(c)
    ]


def _names_your_own_script(command: str) -> bool:
    """Whether ``command`` runs your own script: a bare ``train.py`` the repository lacks.

    A path (``examples/x.py``) is the repository's and must exist, so a misspelt one fails.
    """
    words = [w for w in shlex.split(command) if w.endswith(".py") and "=" not in w]
    return any("/" not in w and not (ROOT / w).exists() for w in words)


@pytest.mark.framework
@pytest.mark.composer  # the commands run in both worlds' environments
def test_every_quick_documented_command_works_as_written(tmp_path):
    """Runs each in a copy of the docs and examples, from a folder laid out like the repository."""
    for venv in (".venv", ".venv-composer"):
        (tmp_path / venv).symlink_to(ROOT / venv)
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    quick = _quick_commands()
    assert any("rankguard report" in c for c in quick), quick
    assert any(QUICK_EXAMPLES[0] in c for c in quick), quick
    for command in quick:
        done = subprocess.run(
            shlex.split(command), cwd=tmp_path, capture_output=True, text=True, timeout=180
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{command}:\n{output[-3000:]}"
        if " examples/" in command:  # a healthy example run: nothing for rankguard to say
            assert "WARNING rankguard" not in output and "ERROR rankguard" not in output
            assert (tmp_path / "out" / "examples").is_dir()  # it wrote where the docs say


def test_outputs_are_normalised_so_a_rerun_elsewhere_compares_equal():
    host = generate.socket.gethostname()
    raw = (
        f"[rank 1] ERROR x: This is rank 1, host {host}, pid 31234: stuck 6 s, idle 5.62 s. "
        f"Stacks in {ROOT}/out/examples/rankguard_reports/rank1.txt; store 127.0.0.1:29731; "
        "called from batch_parity.py:217; 21.9 GiB is available (MemAvailable); /tmp/tmpab12/x and "
        "forward 31.1 ms per batch (score 0.67 < threshold 0.8)\n"
        "W1123 19:41:34.931000 4785 torch/distributed/run.py:766] Sending process 4845 (pid: 4798)"
    )
    assert generate.normalise(raw) == (
        "[rank 1] ERROR x: This is rank 1, host HOST, pid N: stuck N s, idle N.N s. "
        "Stacks in out/examples/rankguard_reports/rank1.txt; store 127.0.0.1:PORT; "
        "called from batch_parity.py:N; N GiB is available (MemAvailable); /tmp/... and "
        "forward N ms per batch (score N < threshold 0.8)\n"
        "W DATE TIME PID torch/distributed/run.py:N] Sending process N (pid: N)"
    )
    assert generate.normalise(generate.normalise(raw)) == generate.normalise(raw)


def test_a_rerun_is_compared_with_its_recording_rank_by_rank():
    (run,) = [r for r in generate.runs() if r.name == "torch.unseeded_split.with"]
    recorded = "\n".join(generate.read_recording(run).lines)
    assert generate.says_otherwise(run, recorded) == []
    # Another rank's split gives other content hashes: not a difference.
    rehashed = re.sub(r"hash [0-9a-f]{8}", "hash 0badcafe", recorded)
    assert rehashed != recorded and generate.says_otherwise(run, rehashed) == []
    # Rank 1 names another loader: a difference, on rank 1 only.
    reworded = "\n".join(
        line.replace("loader 'eval'", "loader 'other'") if line.startswith("[rank 1]") else line
        for line in recorded.splitlines()
    )
    differences = generate.says_otherwise(run, reworded)
    assert differences and all("[rank 1]" in d for d in differences)
    # Rank 0's log alone (a launcher that shows rank 0's only) is compared for rank 0.
    rank0 = "\n".join(line for line in recorded.splitlines() if line.startswith("[rank 0]"))
    assert generate.says_otherwise(run, rank0) == []


def test_a_rerun_whose_message_has_a_line_more_or_less_is_told_apart():
    (run,) = [r for r in generate.runs() if r.name == "composer.post_eval_hang.with"]
    recorded = generate.read_recording(run).lines
    assert generate.says_otherwise(run, "\n".join(recorded)) == []
    continuation = next(i for i, line in enumerate(recorded) if "your code at" in line)
    shorter = recorded[:continuation] + recorded[continuation + 1 :]
    assert generate.says_otherwise(run, "\n".join(shorter))
