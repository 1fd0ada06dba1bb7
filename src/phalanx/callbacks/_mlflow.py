"""`px.callbacks.MLflowLogger`: a run's metrics and parameters logged to an
MLflow run, continued across a resume.

What is logged when is `ScalarLogger`'s; this module creates, ends and
reopens the MLflow run through an `MlflowClient` (MLflow's active run is left
alone), spells names as MLflow accepts them, logs no step a continued run
already has, and raises MLflow's failures as `TrackerError`. It needs mlflow
(an optional extra).
"""

import contextlib
import os
import pathlib
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, final

from typing_extensions import override

from .._log import logger
from .._typing import validates_own_arguments
from ._base import StepInfo
from ._hparams import check_config, flatten_config, hyperparameters
from ._scalar_logger import ScalarLogger
from ._tracker_error import tracker_call


if TYPE_CHECKING:
    from mlflow import MlflowClient


@final
class MLflowLogger(ScalarLogger):
    """Logs metrics and hyperparameters to an MLflow run.

    Every `log_every` steps the step's own metrics go to ``train/<name>``; at
    each epoch end the epoch's train means go to ``epoch/<name>`` and its
    evaluation to ``eval/<name>`` (``eval_loss`` → ``eval/loss``), as
    `TensorBoardLogger` names them, each at the global step (updates made
    so far). Values earlier callbacks add (e.g. ``lr``) are logged too.
    MLflow accepts only letters, digits, ``_ - . /`` and spaces in a name
    (``:`` except on Windows): in a metric or parameter name any other
    character, and a ``/`` inside a metric's own name, becomes ``_``
    (``top@5`` → ``train/top_5``).

    The run's parameters are `hyperparameters` of the trainer (strategy,
    devices, precision, model class and size, optimizer state, ...) merged
    with `config` (whose keys win where both name one; nested mappings are
    flattened to dotted names), logged as strings when the run is created.

    The run is created at the first `fit` (through an `mlflow.MlflowClient`:
    MLflow's active run is left alone; its id is `run_id`) and ended when
    each fit returns (``FINISHED``) or raises (``KILLED`` after an
    interrupt or preemption, ``FAILED`` otherwise); a later fit reopens it.

    Resume: `state_dict` holds the run's id and tracking URI, so after
    `load_state_dict` (``fit(..., resume="latest")`` does it through a
    `Checkpoint`) the next fit continues the same run. The steps the
    interrupted process logged after its checkpoint are replayed
    identically, and none is logged twice: for each metric, the run's
    history says the last step it has, and the logger logs only later ones.
    A parameter the run has already keeps its value (MLflow's parameters
    cannot change; a different new value is reported, not logged).

    A failure of MLflow's (a tracking server that does not answer, a store
    it cannot open) is raised as `TrackerError`, MLflow's exception its
    ``__cause__``. MLflow retries an unanswered request for about 4 minutes
    by default (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``,
    ``MLFLOW_HTTP_REQUEST_TIMEOUT``).

    Requires ``pip install 'phalanx[mlflow]'``. MLflow 3 refuses a ``file:``
    tracking URI (a local ``mlruns`` folder) unless ``MLFLOW_ALLOW_FILE_STORE``
    is ``true``; a ``sqlite:`` one (MLflow 3's default) needs the full
    ``mlflow`` package.

    Example:
        <!-- skip: needs an MLflow tracking server at localhost:5000 -->
        ```python
        tracker = px.callbacks.MLflowLogger(
            "mnist", tracking_uri="http://localhost:5000", config={"lr": 1e-3}
        )
        saves = px.callbacks.Checkpoint("runs/mnist/checkpoints")
        trainer = px.DataParallelTrainer(
            model, optax.adam(1e-3), callbacks=[tracker, saves]
        )
        trainer.fit(data, epochs=3, eval_data=test, resume="latest")  # continued
        ```
    """

    @validates_own_arguments
    def __init__(
        self,
        experiment: str | None = None,
        *,
        tracking_uri: str | os.PathLike[str] | None = None,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        log_every: int = 10,
    ):
        """
        Args:
            experiment: the experiment's name (created if missing); None:
                ``MLFLOW_EXPERIMENT_NAME``, else MLflow's default experiment.
            tracking_uri: where runs are stored (``http://...``,
                ``sqlite:///mlflow.db``, ``file:///...``, or a folder, read as a
                ``file:`` URI); None: MLflow's (``MLFLOW_TRACKING_URI``).
            run_name: the new run's name; None: MLflow picks one.
            config: the run's own settings (e.g. the command line's options),
                logged with the trainer's `hyperparameters`.
            log_every: log the step's metrics after every this many steps.

        Raises:
            ImportError: mlflow is not installed.
            TrackerError: (from `fit`) MLflow failed to start, log to or end
                the run.
            TypeError: `experiment`, `tracking_uri` or `run_name` is not a
                str (or None), or `config` not a mapping with str keys.
            ValueError: `experiment` is empty or `log_every` is invalid.
        """
        try:
            import mlflow  # noqa: F401
        except ImportError as error:
            raise ImportError(
                "MLflowLogger needs mlflow; install it with "
                "pip install 'phalanx[mlflow]'"
            ) from error
        for name, value in (("experiment", experiment), ("run_name", run_name)):
            if value is not None and not isinstance(value, str):
                raise TypeError(
                    f"{name}={value!r} must be a str or None, e.g. {name}='mnist'"
                )
        if experiment == "":
            raise ValueError("experiment='' names no experiment; pass a name or None")
        if isinstance(tracking_uri, os.PathLike):
            tracking_uri = pathlib.Path(tracking_uri).absolute().as_uri()
        if tracking_uri is not None and not isinstance(tracking_uri, str):
            raise TypeError(
                f"tracking_uri={tracking_uri!r} must be a str, a path or None, "
                "e.g. tracking_uri='http://localhost:5000'"
            )
        super().__init__(log_every)
        self.experiment = experiment
        self.tracking_uri = tracking_uri
        self.run_name = run_name
        self.config = check_config(config)
        self.run_id: str | None = None
        self._client: MlflowClient | None = None
        # Where the run is: the URI the first fit resolved, or a restored one.
        self._run_uri: str | None = None
        # Per metric, the last step the run has: this fit logs later ones only.
        self._floors: dict[str, int] = {}

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        from mlflow import MlflowClient

        params = hyperparameters(info.trainer) | flatten_config(self.config)
        uri = self.tracking_uri or self._run_uri
        with self._calls("open its tracking store", uri or "MLflow's default URI"):
            client = MlflowClient(uri)
        histories = {}  # a continued run's: its metrics' logged steps
        with self._calls("start its run", client.tracking_uri):
            if self.run_id is None:
                experiment = self._experiment_id(client)
                run = client.create_run(experiment, run_name=self.run_name)
            else:
                run = client.get_run(self.run_id)
                client.update_run(self.run_id, status="RUNNING")
                histories = {
                    key: client.get_metric_history(self.run_id, key)
                    for key in run.data.metrics
                }
        self._client, self._run_uri = client, client.tracking_uri
        if self.run_id is None:
            self.run_id = run.info.run_id
            self._floors = {}
        else:
            self._floors = {
                key: max(m.step for m in history) for key, history in histories.items()
            }
            logger.info(
                f"MLflowLogger: continuing MLflow run {self.run_id}; its metrics "
                f"are not logged again up to the step each has (at most "
                f"{max(self._floors.values(), default=0)})"
            )
        self._log_params(client, params, run.data.params)

    def state_dict(self) -> dict[str, Any]:
        """The run's id and tracking URI."""
        return {"run_id": self.run_id, "tracking_uri": self._run_uri}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict`; the next fit continues that run (at the
        saved tracking URI, unless this logger was given one)."""
        self.run_id = state["run_id"]
        self._run_uri = state["tracking_uri"]

    # ----------------------------------------------------------- internals

    def _experiment_id(self, client: "MlflowClient") -> str:
        from mlflow.environment_variables import (
            MLFLOW_EXPERIMENT_ID,
            MLFLOW_EXPERIMENT_NAME,
        )
        from mlflow.tracking.default_experiment import DEFAULT_EXPERIMENT_ID

        name = self.experiment or MLFLOW_EXPERIMENT_NAME.get()
        if not name:
            return MLFLOW_EXPERIMENT_ID.get() or DEFAULT_EXPERIMENT_ID
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        return client.create_experiment(name)

    def _log_params(
        self, client: "MlflowClient", params: dict[str, Any], logged: dict[str, str]
    ) -> None:
        """Log `params` the run lacks; report those it has with another value."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        new = []
        for key, value in params.items():
            name, text = _name(key), str(value)[:MAX_PARAM_VAL_LENGTH]
            if name not in logged:
                new.append(Param(name, text))
            elif logged[name] != text:
                logger.warning(
                    f"MLflowLogger: run {self.run_id} keeps {name}={logged[name]!r}; "
                    f"this fit's {text!r} is not logged (MLflow parameters cannot "
                    "change)"
                )
        assert self.run_id is not None
        if new:
            with self._calls(f"log the parameters of run {self.run_id}"):
                client.log_batch(self.run_id, params=new)

    @override
    def _tag(self, prefix: str, name: str) -> str:
        """A ``/`` in the metric's own name becomes ``_``, as does each
        character MLflow refuses."""
        return prefix + _name(name.replace("/", "_"))

    @override
    def _log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        assert self._client is not None and self.run_id is not None
        timestamp = int(time.time() * 1000)
        batch = [
            Metric(key, value, timestamp, step)
            for key, value in scalars.items()
            if step > self._floors.get(key, -1)
        ]
        if batch:
            with self._calls(f"log metrics to run {self.run_id}"):
                self._client.log_batch(self.run_id, metrics=batch)

    @override
    def _close(self, error: BaseException | None = None) -> None:
        """End the run as ``FINISHED`` where `fit` returned, ``KILLED``
        after an interrupt (or preemption), else ``FAILED``."""
        if error is None:
            status = "FINISHED"
        else:
            status = "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
        if self._client is not None and self.run_id is not None:
            client, self._client = self._client, None
            with self._calls(f"end run {self.run_id} as {status}"):
                client.set_terminated(self.run_id, status)

    def _calls(
        self, what: str, where: str | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """MLflow's errors inside, as a `TrackerError` saying what failed."""
        where = where or self._run_uri or "MLFLOW_TRACKING_URI"
        return tracker_call(
            "MLflowLogger",
            f"{what} at {where}",
            "check that the tracking server runs there (or that the store can "
            "be opened), or pass another tracking_uri / MLFLOW_TRACKING_URI",
        )


def _name(name: str) -> str:
    """`name` with each character MLflow refuses (or refuses on some system,
    such as ``:``) replaced by ``_``; a name of dots only is all ``_``."""
    name = re.sub(r"[^\w\-. /]", "_", name)
    return "_" * len(name) if name.strip(".") == "" else name
