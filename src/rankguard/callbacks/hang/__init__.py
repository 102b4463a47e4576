"""HangWatchdog and its pure decisions.

Calibrated deadlines, proven deadlocks, the cross-rank diagnosis, report
files and timelines.
See docs/hang.md.
"""
