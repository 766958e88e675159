"""Layer 1, the decision cores: pure folds of the event stream. No I/O, no clock, no unseeded randomness."""
