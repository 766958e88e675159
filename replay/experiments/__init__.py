"""`evolving experiments`: the paper's evaluation matrix, reports and plots."""
