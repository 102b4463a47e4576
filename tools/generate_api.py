"""Writes the public classes of every integration module from the guard registry.

Each integration (``src/rankguard/integrations/composer.py``, ...) exports ``RankGuard`` and
one class per registered guard (``src/rankguard/callbacks/registry.py``, ``GUARDS``). This
script writes them at the end of each module, after the line :data:`BEGIN`,
with every setting in their ``__init__`` signature, so that editors and type
checkers show and check them: ``RankGuard(exchange_timeout_s, *, hang_watchdog=...,
...)`` with one keyword per guard, and each single-guard class with that
guard's own settings (names, types and defaults from the guard's ``__init__``).
What runs is :func:`rankguard.integrations._common.bundle_init` and
:func:`~rankguard.integrations._common.guard_init`. ``tests/integrations/test_api.py`` fails
when a module's block is not what this script writes now.

Usage::

    .venv/bin/python tools/generate_api.py           # rewrite the blocks
    .venv/bin/python tools/generate_api.py --check   # exit 1, naming the stale modules
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTEGRATIONS_DIR = ROOT / "src" / "rankguard" / "integrations"
#: The first line of the generated block; everything after it is rewritten.
BEGIN = "# -- Public classes: written by tools/generate_api.py from the guard registry; do not edit"
#: Longest line ruff allows (``pyproject.toml``); a longer generated line gets a noqa for E501.
LINE_LENGTH = 100


@dataclass(frozen=True)
class Integration:
    """What one integration module's generated classes differ in.

    Args:
        base: The adapter base class, defined in the module above the block.
        kind: What the classes are in the framework, for their docstrings.
        defaults: The module's constant of framework defaults per guard, if any.
        exports: The module's other public names, first in its ``__all__``.
    """

    base: str
    kind: str
    defaults: str | None = None
    exports: tuple[str, ...] = ()


INTEGRATIONS = {
    "composer": Integration("_ComposerAdapter", "a Composer callback"),
    "lightning": Integration("_LightningAdapter", "a Lightning callback", "LIGHTNING_DEFAULTS"),
    "transformers": Integration(
        "_TrainerAdapter", "a Hugging Face ``TrainerCallback``", exports=("calling_trainer",)
    ),
    "torch": Integration(
        "_LoopGuard",
        "a hand-written loop's guard (``guard.fit``)",
        exports=("EvalLoader", "Run", "TrainLoader"),
    ),
    "olmo_core": Integration(
        "_OlmoCoreAdapter",
        "an OLMo-core ``Callback``",
        "DEFAULTS",
        exports=("checkpoint_to_load", "hook_trainer", "save_options"),
    ),
}

#: Annotations a guard setting may have: they must mean the same in every integration module.
_BUILTIN_TYPES = re.compile(r"(float|int|str|bool|None)( \| (float|int|str|bool|None))*")


def _literal(value: object) -> str:
    """``value`` as source, as ruff formats it (double quotes)."""
    if isinstance(value, str) and '"' not in value and "\\" not in value:
        return f'"{value}"'
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)
    raise ValueError(f"no literal for default {value!r}: give the setting a plain default")


def _line(text: str) -> str:
    return text if len(text) <= LINE_LENGTH else f"{text}  # noqa: E501"


def _docstring(text: str) -> list[str]:
    r"""A class docstring whose ``__doc__`` is exactly ``text`` (no quotes or backslashes)."""
    if '"""' in text or "\\" in text:
        raise ValueError(f"cannot write {text!r} as a docstring")
    return [_line(line) for line in f'    """{text}"""'.split("\n")]


def _init(decorator: str, params: list[str], class_name: str) -> list[str]:
    return [
        f"    @{decorator}",
        "    def __init__(",
        "        self,",
        *[_line(f"        {param},") for param in params],
        "    ) -> None:",
        f'        """Builds the guards of :class:`{class_name}`."""',
    ]


def _guard_params(guard: type) -> list[str]:
    params = ["*"]
    for param in inspect.signature(guard.__init__).parameters.values():
        if param.name == "self":
            continue
        if param.kind is not param.KEYWORD_ONLY:
            raise ValueError(f"{guard.__name__}.__init__: {param.name} is not keyword-only")
        if not isinstance(param.annotation, str) or not _BUILTIN_TYPES.fullmatch(param.annotation):
            raise ValueError(
                f"{guard.__name__}.{param.name}: annotation {param.annotation!r} is not a "
                "union of float, int, str, bool and None"
            )
        params.append(f"{param.name}: {param.annotation} = {_literal(param.default)}")
    return params


def render_block(integration: Integration) -> str:
    """The generated block of one integration module, from :data:`BEGIN` to the end."""
    from rankguard.callbacks.registry import GUARDS
    from rankguard.integrations._common import BUNDLE_DOC, _bundle_signature, class_name

    spec = integration
    defaults = f", {spec.defaults}" if spec.defaults else ""
    bundle_params = []
    for param in list(_bundle_signature().parameters.values())[1:]:
        if param.kind is param.KEYWORD_ONLY and "*" not in bundle_params:
            bundle_params.append("*")
        annotation = "float" if param.name == "exchange_timeout_s" else "dict[str, Any] | bool"
        bundle_params.append(f"{param.name}: {annotation} = {_literal(param.default)}")
    out = [
        BEGIN,
        "# (tests/integrations/test_api.py checks it): run `python tools/generate_api.py` after",
        "# changing a guard's settings or the registry.",
        "",
        "",
        f"class RankGuard({spec.base}):",
        *_docstring(BUNDLE_DOC.format(kind=spec.kind)),
        "",
        *_init(f"bundle_init({spec.base}{defaults})", bundle_params, "RankGuard"),
    ]
    what = f"{spec.kind[0].upper()}{spec.kind[1:]}"
    names = ["RankGuard"]
    for guard_name, guard in GUARDS.items():
        name = class_name(guard_name)
        names.append(name)
        doc = f"{what} for :class:`rankguard.callbacks.{name}` (same arguments)."
        decorator = f'guard_init({spec.base}, "{guard_name}"{defaults})'
        out += [
            "",
            "",
            f"class {name}({spec.base}):",
            *_docstring(doc),
            "",
            *_init(decorator, _guard_params(guard), name),
        ]
    exported = [*spec.exports, *sorted(names)]
    # The module's own names first, as before the classes were written out (not sorted).
    opening = "__all__ = [  # noqa: RUF022" if spec.exports else "__all__ = ["
    out += ["", "", opening, *[f'    "{name}",' for name in exported], "]"]
    return "\n".join(out) + "\n"


def module_path(name: str) -> Path:
    """The source file of integration ``name``."""
    return INTEGRATIONS_DIR / f"{name}.py"


def rendered(name: str) -> str:
    """Integration ``name``'s source with its block as this script writes it now."""
    source = module_path(name).read_text(encoding="utf-8")
    head, found, _ = source.partition(BEGIN)
    if not found:
        raise ValueError(f"{module_path(name)} has no line {BEGIN!r}")
    return head + render_block(INTEGRATIONS[name])


def stale() -> list[str]:
    """The integration modules whose generated block is not what :func:`rendered` writes."""
    return [
        name
        for name in INTEGRATIONS
        if module_path(name).read_text(encoding="utf-8") != rendered(name)
    ]


def main(argv: list[str] | None = None) -> int:
    """Rewrites the stale blocks, or with ``--check`` names them and returns 1."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale modules")
    args = parser.parse_args(argv)
    names = stale()
    for name in names:
        path = module_path(name).relative_to(ROOT)
        if args.check:
            sys.stderr.write(f"{path}: stale, run .venv/bin/python tools/generate_api.py\n")
        else:
            module_path(name).write_text(rendered(name), encoding="utf-8")
            sys.stderr.write(f"{path}: rewritten\n")
    return 1 if args.check and names else 0


if __name__ == "__main__":
    sys.exit(main())
