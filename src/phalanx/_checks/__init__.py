"""Checks of what a run is given: arguments, batches, hooks' returns (private)."""
