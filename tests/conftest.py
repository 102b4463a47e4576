"""Which world each test runs in (the Makefile's ``test-today`` and ``test-composer``).

Composer lives in its own environment (``.venv-composer``: mosaicml pins torch < 2.7.1), so a
test that needs it carries the marker ``composer``: set here for every test whose name, or a
fixture it uses, names Composer (or llm-foundry's Composer callbacks), and by hand
(``@pytest.mark.composer``) elsewhere. ``older`` marks the short smoke of the older Lightning,
transformers 4 and OLMo-core 2.4 that Composer's world also runs.
"""

from __future__ import annotations

import os

import pytest

from benchmarks.launch import RESOLVER_ENV

# Every rank and job a test starts inherits it (see RESOLVER_ENV: a dropped DNS query of torch's
# stalled a store connection for 5-10 s).
for _name, _value in RESOLVER_ENV.items():
    os.environ.setdefault(_name, _value)

#: Words in a test's id or in one of its fixtures' names that mean it needs Composer.
COMPOSER_WORDS = ("composer", "llmfoundry")


def _needs_composer(item: pytest.Item) -> bool:
    names = [item.nodeid.lower(), *getattr(item, "fixturenames", ())]
    return any(word in name for name in names for word in COMPOSER_WORDS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks every test that needs Composer with ``composer``."""
    for item in items:
        if _needs_composer(item) and not item.get_closest_marker("composer"):
            item.add_marker(pytest.mark.composer)
