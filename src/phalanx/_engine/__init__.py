"""The step pipeline: feed, batches, compiled steps, the loop (private)."""
