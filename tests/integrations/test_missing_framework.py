"""An integration whose framework is not installed names the pip extra that installs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

#: integration -> (the framework module blocked, the extra the message must name)
CASES = {
    "composer": ("composer", "composer"),
    "lightning": ("lightning", "lightning"),
    "transformers": ("accelerate", "transformers"),
    "olmo_core": ("olmo_core", "olmo-core"),
}

#: Blocks one framework module (an import of it raises ImportError), then imports each
#: integration in a fresh interpreter state and prints what the import raised.
PROBE = """
import importlib, json, sys
blocked, integration = sys.argv[1], sys.argv[2]
sys.modules[blocked] = None
try:
    importlib.import_module(f"rankguard.integrations.{integration}.facts")
except ImportError as exc:
    print(json.dumps([type(exc).__name__, str(exc)]))
else:
    print(json.dumps(None))
"""


def _import_without(blocked: str, integration: str) -> list[str] | None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, blocked, integration],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_importing_any_module_of_an_integration_without_its_framework_names_the_extra():
    for integration, (blocked, extra) in CASES.items():
        raised = _import_without(blocked, integration)
        assert raised is not None, f"{integration} imported without {blocked}"
        kind, message = raised
        assert kind == "ImportError"
        assert message.startswith(f"rankguard.integrations.{integration} needs "), message
        assert f"pip install 'rankguard[{extra}]'" in message
