from .._state._snapshot import SnapshotStore as SnapshotStore
from ._errors import CheckpointWriteError as CheckpointWriteError
from ._model_file import load_model as load_model, save_model as save_model
