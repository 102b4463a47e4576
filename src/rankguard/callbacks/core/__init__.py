"""The core every guard and adapter builds on.

Events, the guard runner, errors, the side channel and its background
exchanges, rank and node text, settings checks.
See docs/design.md.
"""
