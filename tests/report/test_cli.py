"""The newcomer's surface: ``import rankguard``, the ``rankguard`` command, the hang timeline."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import rankguard
from rankguard import cli
from rankguard.callbacks.hang.report import write_heartbeats
from rankguard.report.timeline import MAX_ROWS, build_timeline, plot_timeline, title

ROOT = Path(__file__).resolve().parents[2]


def test_import_rankguard_gives_the_version_and_points_to_the_integrations():
    assert rankguard.__version__ == "0.1.0"
    assert {"composer", "lightning"} <= set(rankguard.integrations_available())
    with pytest.raises(AttributeError) as missing:
        rankguard.RankGuard  # noqa: B018
    message = str(missing.value)
    assert "from rankguard.integrations.composer import RankGuard" in message
    assert "rankguard.integrations.lightning" in message
    assert not hasattr(rankguard, "RankGuard")  # still an AttributeError for tools
    assert rankguard.callbacks.HANG_EXIT_CODE == 75  # subpackages load on first use


def test_rankguard_help_says_what_each_command_does_with_an_example(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "report    merge a HangWatchdog report's stacks and draw its timeline" in text
    assert "rankguard report ./rankguard_reports" in text
    with pytest.raises(SystemExit):
        cli.main(["report", "--help"])
    text = capsys.readouterr().out
    assert "usage: rankguard report [-h] DIR" in text
    assert "timeline.png" in text and "examples:" in text and "Args:" not in text
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out == f"rankguard {rankguard.__version__}\n"
    assert cli.main([]) == 2  # no command: the help, on stderr
    assert "usage: rankguard" in capsys.readouterr().err


def _beats(t0: float, events: list[str], step_s: float = 0.1) -> list[dict]:
    return [
        {"t": t0 + i * step_s, "event": e, "phase": e.replace("_", " "), "step": 1}
        for i, e in enumerate(events)
    ]


TRAIN = ["fit_start", "data_fetch_start", "data_fetch_end", "train_batch_start", "train_batch_end"]
EVAL = ["eval_start", "eval_batch_start", "eval_batch_end", "eval_end"]


def _report(t: float, deadline_s: float, blocked_in: str | None = None) -> dict:
    return {"t": t, "event": "report", "deadline_s": deadline_s, "blocked_in": blocked_in}


def test_timeline_shows_who_stopped_first_where_and_the_deadline_it_passed():
    records = {
        # rank 2 stops after eval at t=1000.8; rank 3 stops later, after its own eval
        2: [*_beats(1000.0, TRAIN + EVAL[:-1]), *_beats(1000.8, ["eval_end"])],
        3: [*_beats(1000.0, TRAIN + EVAL), *_beats(1001.5, ["data_fetch_start"])],
        0: _beats(1000.0, [*TRAIN, *EVAL, "data_fetch_start"]),
    }
    records[2].append(_report(1006.0, 5.0))
    records[3].append(_report(1006.0, 5.0))
    records[0].append(_report(1006.0, 5.0, blocked_in="all_reduce, called from trainer.py:1"))
    timeline = build_timeline(records)
    assert timeline.first == 2  # of the stuck ranks, the one whose progress stopped first
    assert timeline.origin == 1000.8  # x = 0 is rank 2's last heartbeat
    assert timeline.deadline == pytest.approx(5.0)  # its deadline, 5 s after that
    row = timeline.rows[2]
    assert row.last_progress == pytest.approx(0.0) and row.last_phase == "eval end"
    assert row.stalled.phase == "stuck" and row.stalled.end == pytest.approx(5.2)
    assert timeline.rows[0].stalled.phase == "waiting"
    # The whole recorded history, not only its end: the first heartbeat starts each row.
    assert timeline.start == pytest.approx(-0.8)
    phases = [s.phase for s in timeline.rows[0].spans]
    assert phases[:4] == ["startup", "data fetch", "startup", "startup"]  # before a step ended
    assert {"train", "eval", "after eval"} <= set(phases)
    assert timeline.drawn_ranks() == [2, 3, 0]  # stuck ranks first
    assert title(timeline).startswith("rank 2 stopped first, in eval end; its deadline (5 s)")


def test_timeline_names_the_ceiling_after_a_calibrated_deadline_and_draws_it_once_reached():
    records = {0: _beats(100.0, TRAIN), 1: _beats(100.0, TRAIN[:3])}
    stage_1 = {**_report(131.0, 30.0), "ceiling_s": 600.0}  # reported at the deadline
    timeline = build_timeline({0: records[0], 1: [*records[1], stage_1]})
    assert timeline.first == 1 and timeline.deadline == pytest.approx(30.0)
    assert timeline.ceiling == pytest.approx(600.0) and not timeline.ceiling_drawn
    assert title(timeline).endswith("; its ceiling (600 s, abort) due at 600.0 s")
    stage_2 = {**_report(701.0, 30.0), "ceiling_s": 600.0}  # and again at the ceiling
    timeline = build_timeline({0: records[0], 1: [*records[1], stage_2]})
    assert timeline.ceiling_drawn and title(timeline).endswith("reached at 600.0 s")
    one_stage = {**_report(131.0, 30.0), "ceiling_s": 30.0}  # the deadline is the ceiling
    assert build_timeline({1: [*records[1], one_stage]}).ceiling is None


def test_timeline_from_heartbeats_alone_takes_the_earliest_stop_and_draws_no_deadline():
    timeline = build_timeline({0: _beats(50.0, TRAIN), 1: _beats(50.0, TRAIN[:3])})
    assert timeline.first == 1 and timeline.deadline is None
    assert timeline.rows[1].stalled is None


def test_timeline_png_draws_at_most_max_rows_and_says_how_many_it_left_out(tmp_path):
    ranks = MAX_ROWS + 3
    records = {r: [*_beats(10.0, TRAIN), _report(20.0, 8.0, "all_reduce")] for r in range(ranks)}
    records[17] = [*_beats(10.0, TRAIN[:2]), _report(20.0, 8.0)]
    timeline = plot_timeline(records, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")
    drawn = timeline.drawn_ranks()
    assert len(drawn) == MAX_ROWS and drawn[0] == 17
    assert title(timeline).endswith("(3 more ranks not drawn: see merged.txt)")


def test_report_on_a_folder_of_report_folders_lists_them(tmp_path, capsys):
    for attempt in ("attempt0", "attempt1"):
        write_heartbeats(tmp_path / attempt, 0, _beats(1.0, TRAIN))
        (tmp_path / attempt / "rank0.txt").write_text("rank 0\n\nThread 0x1\n")
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"  {tmp_path / 'attempt0'}\n  {tmp_path / 'attempt1'}\n" in err
    assert cli.main(["report", str(tmp_path / "attempt1")]) == 0
    assert (tmp_path / "attempt1" / "timeline.png").exists()
    record = json.loads((tmp_path / "attempt1" / "rank0.jsonl").read_text().splitlines()[0])
    assert set(record) == {"t", "event", "phase", "step"}


@pytest.mark.slow
def test_a_normal_install_holds_one_rankguard_package_with_every_subpackage(tmp_path):
    """A built wheel, not the editable install: nothing generic lands in site-packages.

    Every package under ``src/`` is in the wheel (``pyproject.toml`` lists them
    one by one: one left out would silently drop out), and each imports from it.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("rankguard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {name.split("/")[0] for name in names if not name.startswith("rankguard-")}
    assert packages == {"rankguard"}
    for module in ("__init__.py", "py.typed", "cli.py", "integrations/_adapter.py"):
        assert f"rankguard/{module}" in names
    in_tree = sorted(
        ".".join(init.parent.relative_to(ROOT / "src").parts)
        for init in (ROOT / "src").rglob("__init__.py")
    )
    in_wheel = sorted(name[: -len("/__init__.py")].replace("/", ".") for name in names
                      if name.endswith("/__init__.py"))  # fmt: skip
    assert in_wheel == in_tree
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # Every package imports from the wheel; an integration whose framework this environment
    # lacks (Composer in today's) says which extra installs it, and nothing else goes wrong.
    check = "\n".join(
        [
            "import importlib, sys",
            f"sys.path.insert(0, {str(site)!r})",
            f"for package in {in_wheel!r}:",
            "    try:",
            "        importlib.import_module(package)",
            "    except ImportError as exc:",
            '        if "pip install \'rankguard[" not in str(exc):',
            "            raise",
            "import rankguard",
            "print(rankguard.__file__)",
        ]
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-c", check], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith(str(site))
    assert (
        "rankguard = rankguard.cli:main"
        in zipfile.ZipFile(wheel)
        .read(next(n for n in names if n.endswith("entry_points.txt")))
        .decode()
    )


def _incident(directory: Path, ranks: int = 3) -> None:
    """A real report folder: what write_incident leaves for each rank."""
    from rankguard.callbacks.hang.report import write_incident

    for rank in range(ranks):
        summary = "rank 1 stuck 40 s in train batch 12 (deadline 30 s)" if rank == 0 else None
        beats = [{"t": 100.0 + i, "event": "train_batch_end", "phase": f"after train batch {i}",
                  "step": i} for i in range(12)]  # fmt: skip
        write_incident(
            directory, rank, f"rank {rank}, host h, pid 1: train batch 12", beats, summary
        )


def test_report_with_a_rank_file_cut_mid_line_reads_the_rest_and_names_the_cut_rank(
    tmp_path, capsys
):
    _incident(tmp_path)
    path = tmp_path / "rank1.jsonl"
    text = path.read_text()
    path.write_text(text[: len(text) - 25])  # killed mid-write: the last line is cut
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rank 1 stuck 40 s in train batch 12"), out  # the verdict
    assert "Incomplete report:\n  rank 1: rank1.jsonl was cut (1 unreadable line(s)" in out
    assert "read the 11 record(s) before." in out
    assert (tmp_path / "timeline.png").exists()


def test_report_with_a_rank_missing_or_unreadable_names_it_and_still_gives_the_verdict(
    tmp_path, capsys
):
    _incident(tmp_path)
    (tmp_path / "rank1.jsonl").unlink()
    (tmp_path / "rank1.txt").unlink()
    (tmp_path / "rank2.jsonl").write_bytes(b"\xff\xfe{not json\n")
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rank 1 stuck 40 s in train batch 12"), out
    assert "rank 1: no rank1.txt or rank1.jsonl (never written, or lost)." in out
    assert "rank 2: rank2.jsonl was cut (1 unreadable line(s)" in out
    assert "wrote" in out and (tmp_path / "merged.txt").read_text().count("Incomplete") == 1
