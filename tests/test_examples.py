"""Every example script runs: healthy passes clean, an injected fault is caught."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.framework

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = Path(sys.executable).parent / "composer"


def composer_example(tmp_path, *args):
    cmd = [str(LAUNCHER), "-n", "2", str(ROOT / "examples" / "composer_train.py"), *args]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)


def test_composer_example_healthy_run_is_clean(tmp_path):
    proc = composer_example(tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "training finished" in output
    assert [line for line in output.splitlines() if "WARNING rankguard" in line] == []


def test_composer_example_drop_last_fault_is_caught(tmp_path):
    proc = composer_example(tmp_path, "--fault", "drop_last")
    assert proc.returncode != 0
    assert "DropLastMismatchError" in proc.stdout + proc.stderr
