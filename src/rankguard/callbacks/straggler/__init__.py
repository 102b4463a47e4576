"""StragglerMonitor: the rank whose compute makes every other rank wait.

Forward-pass clocks (host time, CUDA device time) and the pure scores.
See docs/straggler.md.
"""
