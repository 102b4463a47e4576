"""How many batches each rank runs: BatchParityGuard and DropLastGuard.

What a loader really yields on a rank, beyond its ``__len__``.
See docs/data.md.
"""
