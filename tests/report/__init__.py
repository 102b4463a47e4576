"""The `rankguard report` command: reading a hang report folder, the merged stacks, the timeline."""
