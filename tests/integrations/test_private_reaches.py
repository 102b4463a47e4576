"""No adapter reads a framework's private names outside ``rankguard.integrations.private``.

Each framework's private reaches are named functions in
``src/rankguard/integrations/private/<framework>.py``, each with a test of its own
(``tests/integrations/test_private_<framework>.py``); torch's are in
``src/rankguard/callbacks/core/torch_private.py``. This scans every other module of
``rankguard.integrations`` for the forms a reach takes: an underscored attribute of a
framework object, a frame's locals, a closure's cells, an enum's raw value.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

INTEGRATIONS = Path(__file__).resolve().parents[2] / "src" / "rankguard" / "integrations"
#: What the adapters call the framework objects they are handed.
FRAMEWORK_OBJECTS = (
    "trainer|state|strategy|pl_module|module|args|control|loop|epoch_loop|fit_loop|"
    "checkpointer|evaluator|train_module|data_loader|dataloader|loader|event|saver|"
    "logger|callback|accelerator|timestamp|results|options|group|torch|dist"
)
REACH = re.compile(
    rf"\b(?:{FRAMEWORK_OBJECTS})\._[A-Za-z]\w*|\.f_locals\b|__closure__|\._value_\b|"
    r"\bsys\._getframe\b|\bf_back\b|\b(?:get|set|has)attr\([^)]*['\"]_\w"
)


#: Reaches left inline on purpose, by module: Composer calls ``run_event`` some 13 times a
#: batch, and its first test reads the event's value string directly (a call to
#: ``private.composer`` would cost more than the whole test); what it reads is
#: ``private.composer.EVENT_VALUE``, tested in ``tests/integrations/test_private_composer.py``.
INLINE = {"composer": ["event._value_"]}


def _modules() -> list[Path]:
    """Every module of ``rankguard.integrations`` (an integration's package's too) but private/."""
    return sorted(
        p for p in INTEGRATIONS.rglob("*.py") if "private" not in p.relative_to(INTEGRATIONS).parts
    )


def _integration(path: Path) -> str:
    """The integration a module belongs to: ``composer`` for composer.py or composer/*.py."""
    return path.relative_to(INTEGRATIONS).parts[0].removesuffix(".py")


def _code_lines(source: str) -> dict[int, str]:
    """Each line's code without comments and prose strings (an attribute name string stays)."""
    lines: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        name = tok.type == tokenize.STRING and re.fullmatch(r"[\"']_\w+[\"']", tok.string)
        if tok.type in (tokenize.NAME, tokenize.OP, tokenize.NUMBER) or name:
            row = tok.start[0]
            lines[row] = lines.get(row, "") + (" " if tok.type != tokenize.OP else "") + tok.string
    return {row: re.sub(r" ?\. ?", ".", text) for row, text in lines.items()}


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(INTEGRATIONS)))
def test_no_private_reach_outside_the_private_modules(path):
    kept_inline = INLINE.get(_integration(path), ())
    found = [
        f"{path.name}:{row}: {path.read_text().splitlines()[row - 1].strip()}"
        for row, code in sorted(_code_lines(path.read_text()).items())
        if REACH.search(code) and not any(kept in code for kept in kept_inline)
    ]
    assert found == []
