"""``rankguard report DIR``: reads what a HangWatchdog wrote when it found a hang.

- :mod:`~rankguard.report.reader`: each rank's stacks and records, and what is cut or
  missing (a rank killed while writing);
- :mod:`~rankguard.report.cli`: the command, its help, ``merged.txt``;
- :mod:`~rankguard.report.timeline`: ``timeline.png``, every rank's phases and where
  each stopped (needs matplotlib: ``pip install 'rankguard[report]'``).

The writer is the watchdog's (:mod:`rankguard.callbacks.hang.report`); nothing in
``rankguard.callbacks`` imports this package.
"""

from rankguard.report.cli import REPORT_HELP, add_arguments, main, run

__all__ = ["REPORT_HELP", "add_arguments", "main", "run"]
