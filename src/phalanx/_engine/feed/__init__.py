"""The engine's room of batches on their way in: read, checked, padded and
placed, ahead of the step on a background thread."""
