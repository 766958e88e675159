"""The discrete-event cluster simulator: runs, stacks, partitions, figures."""
