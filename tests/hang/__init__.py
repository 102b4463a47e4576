"""Unit tests of the HangWatchdog, its pure decisions and the report CLI."""
