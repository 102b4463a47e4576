"""Checkpoint saves: CheckpointPlanner and SharedDirBarrier.

The host-memory plan of a save and the state's size, what a rank sees of
a folder, and the shared-folder decisions.
See docs/checkpoint.md.
"""
