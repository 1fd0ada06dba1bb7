"""Checkpoints: a run's snapshots in a folder, for an exact resume, and a
model's weights in one file, for inference. Re-exports only; the code lives
in the private modules beside this one."""

from ._errors import CheckpointWriteError as CheckpointWriteError
from ._model_file import load_model as load_model, save_model as save_model
from ._store import SnapshotStore as SnapshotStore
