"""`px.callbacks.WandbLogger`: a run's metrics and settings logged to a
Weights & Biases run, continued across a resume.

What is logged when is `ScalarLogger`'s; this module starts, finishes and
resumes the W&B run, skips the steps a continued run has already (read back
from W&B's local files with `_wandb_log`, without a server) and raises W&B's
failures as `TrackerError`. It needs wandb (an optional extra).
"""

import contextlib
import inspect
import pathlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, final

from typing_extensions import override

from .._log import logger
from .._preemption import Preempted
from .._typing import validates_own_arguments
from .._validate import one_of
from ._base import StepInfo
from ._hparams import check_config, hyperparameters
from ._scalar_logger import ScalarLogger
from ._tracker_error import tracker_call
from ._wandb_log import last_step_on_disk, wait_until_written


if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run


_Mode: TypeAlias = Literal["online", "offline", "disabled", "shared"]
_MODES: tuple[_Mode, ...] = ("online", "offline", "disabled", "shared")
# wandb.init arguments the logger sets itself: it resumes its own run.
_OWN = ("resume", "resume_from", "fork_from")


@final
class WandbLogger(ScalarLogger):
    """Logs metrics and hyperparameters to a Weights & Biases run.

    Every `log_every` steps the step's own metrics go to ``train/<name>``; at
    each epoch end the epoch's train means go to ``epoch/<name>`` and its
    evaluation to ``eval/<name>`` (``eval_loss`` → ``eval/loss``), as
    `TensorBoardLogger` names them. W&B's step (``_step``) is the global
    step (updates made so far), so every curve shares the x-axis. Values
    earlier callbacks add (e.g. ``lr``) are logged too.

    The run's config holds `hyperparameters` of the trainer (strategy,
    devices, precision, model class and size, optimizer state, ...) merged
    with `config` (whose keys win where both name one).

    Each `fit` opens the run and finishes it when it returns (exit code 0)
    or raises (non-zero: W&B marks the run failed; after a preemption it
    is marked preempting first). The run is `run` while a fit runs; it is
    not made `wandb.run` (``reinit="create_new"`` unless you pass another).
    A row is written when a later step is logged or the run finishes, as
    W&B does for rows logged with an explicit step.

    Resume: `state_dict` holds the run's id and project, so after
    `load_state_dict` (``fit(..., resume="latest")`` does it through a
    `Checkpoint`) the next fit continues the same run
    (``wandb.init(id=..., resume="allow")``). The steps the interrupted
    process logged after its checkpoint are replayed identically, and none
    is logged twice: the logger skips every step up to the last one the run
    has, which online W&B reports when it resumes and which the run's
    earlier local parts hold (each fit's ``run-<id>.wandb`` file in the
    wandb folder: offline, resume with the same ``WANDB_DIR`` or ``dir``).
    ``wandb sync`` uploads a run's offline parts in order. A step already
    in the run gets no new values either: if the interrupted process logged
    an epoch's last step but not its end, that epoch has no ``epoch/`` and
    ``eval/`` values.

    A failure of W&B's (a bad setting such as ``WANDB_MODE``, a server that
    does not answer) is raised as `TrackerError`, W&B's exception its
    ``__cause__``.

    Requires ``pip install 'phalanx[wandb]'``.

    Example:
        ```python
        logger = px.callbacks.WandbLogger("mnist", config={"lr": 1e-3}, log_every=50)
        checkpoint = px.callbacks.Checkpoint("runs/mnist/checkpoints")
        trainer = px.DataParallelTrainer(
            model, optax.adam(1e-3), callbacks=[logger, checkpoint]
        )
        trainer.fit(data, epochs=3, eval_data=test, resume="latest")
        ```
    """

    @validates_own_arguments
    def __init__(
        self,
        project: str | None = None,
        *,
        mode: _Mode | None = None,
        config: Mapping[str, Any] | None = None,
        log_every: int = 10,
        **init_kwargs: Any,
    ):
        """
        Args:
            project: the W&B project; None: W&B's default (``WANDB_PROJECT``).
            mode: ``"online"``, ``"offline"`` (written under ``WANDB_DIR`` for
                ``wandb sync``), ``"disabled"`` or ``"shared"``; None: W&B's
                default (``WANDB_MODE``, else online).
            config: the run's own settings (e.g. the command line's options),
                logged with the trainer's `hyperparameters`.
            log_every: log the step's metrics after every this many steps.
            init_kwargs: passed on to `wandb.init` (e.g. ``entity``, ``name``,
                ``group``, ``tags``, ``dir``, ``settings``; ``id``: the new
                run's id).

        Raises:
            ImportError: wandb is not installed.
            TrackerError: (from `fit`) W&B failed to start, log to or finish
                the run.
            TypeError: `project` is not a str, `config` not a mapping with
                str keys, or `init_kwargs` names no `wandb.init` argument.
            ValueError: `mode` or `log_every` is invalid, or `init_kwargs`
                names ``resume``, ``resume_from`` or ``fork_from``.
        """
        try:
            import wandb
        except ImportError as error:
            raise ImportError(
                "WandbLogger needs wandb; install it with pip install 'phalanx[wandb]'"
            ) from error
        if project is not None and not isinstance(project, str):
            raise TypeError(
                f"project={project!r} must be a str or None, e.g. project='mnist'"
            )
        super().__init__(log_every)
        self.project = project
        self.mode: _Mode | None = None if mode is None else one_of("mode", mode, _MODES)
        self.config = check_config(config)
        accepted = inspect.signature(wandb.init).parameters
        for name, value in init_kwargs.items():
            if name in _OWN:
                raise ValueError(
                    f"{name}={value!r}: WandbLogger resumes its own run; leave "
                    f"{name} out and resume training with fit(..., resume=...)"
                )
            if name not in accepted:
                raise TypeError(
                    f"{name}={value!r} is not an argument of wandb.init; pass "
                    f"some of {', '.join(n for n in accepted if n not in _OWN)}"
                )
        run_id = init_kwargs.pop("id", None)
        if run_id is not None and not isinstance(run_id, str):
            raise TypeError(f"id={run_id!r} must be a str, e.g. id='mnist-1'")
        self.init_kwargs = init_kwargs
        self.run: Run | None = None
        self._run_id: str | None = run_id
        self._project: str | None = None  # the run's (continued where it is)
        self._last_step: int | None = None  # the last step logged
        # Steps up to this one are in the run already: this fit skips them.
        self._floor = -1

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        import wandb

        self._close()  # a run the last fit left open (its end was skipped)
        resuming = self._run_id is not None
        config = {**hyperparameters(info.trainer), **self.config}
        with self._calls("start its run"):
            run = wandb.init(
                project=self.project or self._project,
                mode=self.mode,
                id=self._run_id,
                resume="allow" if resuming else None,
                config=config,
                **{"reinit": "create_new", **self.init_kwargs},
            )
        self.run, self._run_id, self._project = run, run.id, run.project
        # Online, a resumed run starts at the step after its last.
        self._floor = max(
            -1 if self._last_step is None else self._last_step, run.starting_step - 1
        )
        if resuming and not run.disabled:
            settings = run.settings
            on_disk = last_step_on_disk(
                pathlib.Path(settings.wandb_dir), pathlib.Path(settings.sync_file)
            )
            self._floor = max(self._floor, on_disk)
        if self._floor >= 0:
            logger.info(
                f"WandbLogger: continuing W&B run {run.id}; steps up to "
                f"{self._floor} are in it already and are not logged again"
            )

    def state_dict(self) -> dict[str, Any]:
        """The run's id and project, and the step last logged."""
        return {
            "run_id": self._run_id,
            "project": self._project,
            "last_step": self._last_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict`; the next fit continues that run."""
        self._close()
        self._run_id = state["run_id"]
        self._project = state["project"]
        self._last_step = state["last_step"]

    # ----------------------------------------------------------- internals

    @override
    def _has(self, step: int) -> bool:
        return step <= self._floor

    @override
    def _log(self, scalars: dict[str, float], step: int) -> None:
        assert self.run is not None
        with self._calls(f"log to run {self.run.id}"):
            self.run.log(scalars, step=step)
        self._last_step = step

    @override
    def _close(self, error: BaseException | None = None) -> None:
        """Finish the run (if one is open): exit code 0 where `fit` returned,
        else non-zero (W&B marks the run failed; a preempted one is marked
        preempting first)."""
        if self.run is None:
            return
        exit_code = 0 if error is None else 1
        if isinstance(error, Preempted):
            exit_code = error.exit_code
            with self._calls(f"mark run {self.run.id} as preempted"):
                self.run.mark_preempting()
        run, self.run = self.run, None
        with self._calls(f"finish run {run.id}"):
            run.finish(exit_code=exit_code)
        if run.offline:  # the next fit reads the file
            wait_until_written(pathlib.Path(run.settings.sync_file))

    def _calls(self, what: str) -> contextlib.AbstractContextManager[None]:
        """W&B's errors inside, as a `TrackerError` saying what failed."""
        return tracker_call(
            "WandbLogger",
            what,
            "check W&B's settings (WANDB_MODE, WANDB_PROJECT, WANDB_API_KEY, "
            "WANDB_DIR, ...) and the logger's arguments, or run W&B offline "
            "(WANDB_MODE=offline)",
        )
