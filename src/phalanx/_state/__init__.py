"""A run's state as values: train state, progress, sums, history (private)."""
