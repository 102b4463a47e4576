"""Unit tests of CheckpointPlanner and SharedDirBarrier (simulated nodes)."""
