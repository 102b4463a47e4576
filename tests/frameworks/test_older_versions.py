"""A smoke of the older Lightning, transformers 4 and OLMo-core 2.4 (Composer's world).

Users who have not moved to today's stack run these; ``make test`` runs this module in
``.venv-composer`` (marker ``older``), where the full suites of these frameworks run in
``.venv``. Each example: a healthy run passes clean, and an uneven eval split is named on
every rank as ``docs/failures.md`` quotes it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.test_examples import ENV, EXAMPLES, rankguard_warnings, says_what_the_docs_quote

pytestmark = [pytest.mark.framework, pytest.mark.older]

TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2"]
#: By their recordings' name in docs/outputs: the example script and how it starts its ranks.
EXAMPLE_RUNS = {
    "lightning": ("lightning_train.py", [sys.executable]),
    "hf": ("hf_trainer.py", TORCHRUN),
    "olmo": ("olmo_core_train.py", TORCHRUN),
}


def run_example(framework: str, tmp_path: Path, *args: str) -> tuple[int, str]:
    script, launcher = EXAMPLE_RUNS[framework]
    cmd = [*launcher, str(EXAMPLES / script), "--workdir", str(tmp_path / "work"), *args]
    done = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=240)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("framework", list(EXAMPLE_RUNS))
def test_healthy_example_passes_clean_on_the_older_framework(framework, tmp_path):
    code, output = run_example(framework, tmp_path)
    assert code == 0, output[-3000:]
    assert "training finished" in output
    assert rankguard_warnings(output) == []


@pytest.mark.parametrize("framework", list(EXAMPLE_RUNS))
def test_uneven_eval_is_named_on_every_rank_on_the_older_framework(framework, tmp_path):
    code, output = run_example(framework, tmp_path, "--fault", "uneven_eval")
    assert code != 0, output[-3000:]
    assert output.count("Ranks see different data") >= 2, output[-3000:]
    says_what_the_docs_quote(f"{framework}.uneven_eval.with", output, tmp_path / "work")
