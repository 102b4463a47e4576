"""Unit tests of what a loader really yields (BatchParityGuard's counts)."""
