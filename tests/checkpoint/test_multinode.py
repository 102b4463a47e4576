"""Two simulated nodes of 4 ranks (one torchrun per node, master on 127.0.0.1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.launch import launch_nodes

pytestmark = pytest.mark.framework

WORKER = Path(__file__).resolve().parents[2] / "benchmarks" / "scale_worker.py"


def test_half_the_ranks_with_a_longer_eval_set_are_named_compactly(tmp_path):
    out = tmp_path / "result.json"
    results = launch_nodes(WORKER, [str(out), "--repeats", "1", "--uneven"], 2, 4, timeout=240)
    assert all(r.returncode == 0 for r in results), results[0].stderr[-3000:]
    ranks = json.loads(out.read_text())["ranks"]
    assert [(r["node"], r["local_rank"]) for r in ranks] == [
        (n, i) for n in (0, 1) for i in range(4)
    ]
    for r in ranks:
        # Every guard runs; the root cause (datasets of different lengths) is named first.
        assert r["error"].startswith("DataInconsistencyError")
        assert (
            "loader 'eval': length differs (ranks 0-3: 128 items; ranks 4-7: 256 items)"
            in (r["error"])
        )
