"""Unit tests of the HangWatchdog and its pure decisions."""
