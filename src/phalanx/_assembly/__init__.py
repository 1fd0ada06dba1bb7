"""The trainer put together (`_parts`: its settings and hooks made into
the parts of a run, once), one `fit` from its arguments to its end
(`_fit`), and what the trainer's other methods do with its parts
(`_operations`). `_trainer.py` is the public surface; this folder is its
machinery above the engine."""
