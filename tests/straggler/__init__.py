"""Unit tests of StragglerMonitor: clocks, scores, 2-rank DDP runs."""
