"""The training loop: passes over the data, the bounded in-flight window,
and the epochs' logs.

The loop takes the run (the state's arrays and its progress, one `Run`)
from the trainer's `RunSlot` and puts the next one there after every
compiled call, so that the trainer, its callbacks and a snapshot always see
the state and progress of the same step; it returns the run it ends with.
It never writes into the trainer: a callback's stop request is read from
``trainer.stop_training``, a signal's is the loop's own, and it ends up in
the returned run's progress (``preempted``).

It tells the fit's `PhaseClock` what it is doing (waiting for data,
dispatching steps and waiting at sync points, its own work, evaluating),
judges the windows between sync points for slow steps, names the compiles
of its train steps, and runs the fit's garbage-collection policy; none of
that waits for the device.
"""

import dataclasses
from collections.abc import Callable, Iterable, Sized
from typing import Any

import jax

from .._checks._batch import empty_data_message, nonfinite_error
from .._state._history import History
from .._state._progress import RunPlan, RunProgress
from .._state._run import Run, RunSlot
from .._state._sums import FLAGS, EpochSums, StepSums
from .._telemetry._alarms import Recompiles, SlowSteps
from .._telemetry._clock import PhaseClock
from .._telemetry._gc import Collector
from .._typing import EvalSets, GCMode, HostMetrics, NanPolicy
from ..callbacks._base import StepInfo, TrainerLike
from ..callbacks._dispatch import Callbacks
from ..data import Resumable
from ..strategies._placement import to_host
from ._feed import Feed
from ._prepare import Preparer


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """How a fit's loop runs (the trainer's settings).

    Attributes:
        prefetch: batches prepared ahead (see the trainer).
        sync_every: how often the host waits for the device (see the trainer).
        nan_policy: what a non-finite gradient does.
        steps_per_call: steps run by one compiled call (see the trainer).
        gc: the garbage-collection policy (see the trainer).
        slow_steps: the slow-step alarm's factor (None: off; see the trainer).
    """

    prefetch: int
    sync_every: int
    nan_policy: NanPolicy
    steps_per_call: int = 1
    gc: GCMode = "auto"
    slow_steps: float | None = 3.0


class FitLoop:
    """One `fit`'s loop, from the run in `slot` to the one `run` returns.

    Attributes:
        slot: where the current run is, read at each call and replaced
            after it (the trainer's: a callback that sets ``trainer.state``
            between steps is seen by the next step).
        feed: the pass being trained on (where its loader stands is what a
            snapshot records while batches are read ahead), or None.
        eval_sets: the sets to evaluate (`fit`'s `eval_data`), or None.
        eval_every: evaluate after every this many steps; None: at epoch ends.
        max_epochs, total_steps: the fit's epochs and steps from the run's
            start, where known up front.
    """

    def __init__(
        self,
        trainer: TrainerLike,
        *,
        slot: RunSlot,
        preparer: Preparer,
        callbacks: Callbacks,
        history: History,
        evaluate: Callable[[EvalSets], HostMetrics],
        settings: LoopSettings,
        data: Iterable[Any],
        eval_sets: EvalSets | None = None,
        eval_every: int | None = None,
        check_metrics: Callable[[tuple[str, ...], tuple[str, ...]], None] | None = None,
        clock: PhaseClock | None = None,
    ):
        """Args:
        trainer: what callbacks are told about (and whose ``stop_training``
            a callback sets).
        check_metrics: called once with a step's and an evaluation's sum
            names before the first step, where they were not known before
            the first batch (the callbacks' monitors are checked against
            them).
        clock: the fit's phase clock, which the loop tells what it is
            doing (one of its own if None).
        (The rest: as the attributes, and the trainer's parts.)
        """
        self.trainer = trainer
        self.slot = slot
        self.preparer = preparer
        self.compiler = preparer.compiler
        self.callbacks = callbacks
        self.history = history
        self.evaluate = evaluate
        self.settings = settings
        self.data = data
        self.eval_sets = eval_sets
        self.eval_every = eval_every
        self.check_metrics = check_metrics
        self.feed: Feed | None = None
        # Examples (all processes') this fit has trained on in the epoch.
        self.epoch_examples = 0
        # The epoch's flags at the last sync point (not donated by the steps).
        self.waiting: jax.Array | None = None
        # The signal that asked the run to stop (set by the handler; noted
        # in the progress where the loop ends).
        self.signal: int | None = None
        self.max_epochs, self.total_steps = plan(data, slot.run.progress)
        self.clock = clock = PhaseClock() if clock is None else clock
        self.collector = Collector(settings.gc)
        self.slow = SlowSteps(clock, settings.slow_steps)
        self.recompiles = Recompiles()
        # The step of the flags `sync` waits on next.
        self.waiting_step = 0

    @property
    def progress(self) -> RunProgress:
        return self.slot.run.progress

    def move_to(self, leaves: list[jax.Array], progress: RunProgress) -> None:
        """The run after a call: its state and progress move together."""
        self.slot.run = Run(leaves, progress)

    def info(
        self,
        metrics: StepSums | HostMetrics | None = None,
        examples: int = 0,
        *,
        step: int | None = None,
        last_in_call: bool = True,
    ) -> StepInfo:
        """What a callback is told now (at `step`, default the progress's)."""
        progress = self.progress
        return StepInfo(
            self.trainer,
            progress.step if step is None else step,
            progress.epoch,
            metrics or {},
            examples=examples,
            max_epochs=self.max_epochs,
            total_steps=self.total_steps,
            start_epoch=progress.plan.start_epoch,
            start_step=progress.plan.start_step,
            last_in_call=last_in_call,
            eval_every=self.eval_every,
            clock=self.clock,
            steps_per_call=self.settings.steps_per_call,
        )

    def data_state(self) -> Any:
        """Where the training data stands after the last batch trained on:
        the pass's note of it while batches are read ahead, else the
        loader's own state (None for data that is not `Resumable`)."""
        feed = self.feed
        if feed is not None and feed.tracking:
            return feed.state
        return self.data.state_dict() if isinstance(self.data, Resumable) else None

    def preempt(self, signum: int) -> None:
        """Stop at the next step boundary (from a signal handler)."""
        self.signal = signum

    def stopping(self) -> bool:
        """Whether a callback or a signal asked the run to stop."""
        return self.signal is not None or self.trainer.stop_training

    def run(self) -> Run:
        """Epochs until the plan is done, a callback stops training, or a
        signal came; the run it ends with (also left in the slot)."""
        with self.collector:
            while not (self.stopping() or self.progress.done()):
                self.run_epoch()
        # (A restored snapshot may carry the signal that stopped its own run.)
        run = self.slot.run
        progress = dataclasses.replace(run.progress, preempted=self.signal)
        self.slot.run = run = run.replace(progress=progress)
        return run

    def run_epoch(self) -> None:
        """Train on one pass over the data (or its rest, after a resume),
        then evaluate (at epoch ends), log the epoch and call `on_epoch_end`;
        return early when the plan is done, a callback stops training, or a
        signal came."""
        data, progress, clock = self.data, self.progress, self.clock
        epoch = progress.epoch
        clock.switch("host")
        self.callbacks.epoch_start(self.info())
        # Resumed from a snapshot of the epoch's last step: only its end is left.
        done = isinstance(data, Sized) and 0 < len(data) <= progress.epoch_steps
        if done and self.preparer.steps is None:
            self.build_steps()
        # A plain re-iterable resumed mid-epoch restarts its epoch: skip what
        # was trained on (a Resumable loader resumes by itself).
        skip = 0 if isinstance(data, Resumable) else progress.epoch_steps
        self.waiting = None  # the epoch's end waits for every step
        self.epoch_examples = 0
        clock.switch("data")  # the pass's first batch is prepared here
        self.feed = feed = Feed(
            self.preparer,
            () if done else data,
            depth=self.settings.prefetch,
            where=lambda i: f"batch {i} of epoch {epoch}",
            skip=skip,
            train=True,
            group=self.settings.steps_per_call,
            rows=progress.pass_rows,
        )
        self.slow.restart(progress.step)
        try:
            with feed:
                self.train_pass(feed)
        finally:
            self.feed = None
            clock.switch("host")
        if self.signal is not None:
            return  # mid-epoch: the checkpoint keeps the epoch's sums
        epoch_sums = self.progress.sums
        if epoch_sums is None:
            raise ValueError(empty_data_message("data", epoch))
        self.collector.at_epoch_end()  # while the device finishes the steps
        clock.switch("step")
        fetched = jax.device_get(epoch_sums)
        clock.switch("host")
        self.slow.waited(self.progress.step)
        logs = self.epoch_logs(fetched)
        if self.eval_sets is not None and self.eval_every is None:
            logs.update(self.evaluation())
        self.history.append(logs, self.progress.step)
        info = self.info(logs, self.epoch_examples)
        run = self.slot.run
        self.slot.run = run.replace(progress=run.progress.next_epoch())
        self.callbacks.epoch_end(info)
        clock.switch("host")

    def evaluation(self) -> HostMetrics:
        """Evaluate every set now (after `progress.step`): recorded in the
        history and told to the callbacks, its metrics the same dict."""
        with self.clock.within("eval"):
            self.callbacks.eval_start(self.info())
            assert self.eval_sets is not None
            metrics = self.evaluate(self.eval_sets)
            progress = self.progress
            self.history.append_evaluation(progress.step, progress.epoch, metrics)
            self.callbacks.eval_end(self.info(metrics))
        # Every step so far is done; the next window starts after it.
        self.slow.restart(progress.step)
        return metrics

    def train_pass(self, feed: Feed) -> None:
        """Compiled calls of `steps_per_call` steps (single steps where the
        pass or the plan has fewer left, or the step size changes) until the
        pass ends, the plan is done, a callback stops training, or a signal
        came; each of those is acted on where a call ends, and a call ends
        at each step ``eval_every`` evaluates after."""
        callbacks, clock, slow = self.callbacks, self.clock, self.slow
        sync_every, k = self.settings.sync_every, self.settings.steps_per_call
        every = self.eval_every
        examples = jax.process_count()  # every process's slice of a batch
        while True:
            left = self.progress.steps_left()
            size = k if left is None else min(k, left)
            if every is not None:  # up to the next evaluation
                size = min(size, every - self.progress.step % every)
            slow.began(clock.switch("data"), self.progress.step)
            group = feed.take(size)
            clock.switch("host")
            if not group:
                return
            steps = self.preparer.built()
            if self.check_metrics is not None:  # once, before the first step
                self.check_metrics(
                    steps.sums.metric_names, steps.eval_sums.metric_names
                )
                self.check_metrics = None
            run = self.slot.run
            progress, leaves = run.progress, run.leaves
            epoch_sums = progress.sums
            if epoch_sums is None:
                epoch_sums = self.compiler.epoch_sums(steps)
                progress = dataclasses.replace(progress, sum_names=steps.sums.names)
            elif progress.sum_names != steps.sums.names:
                raise ValueError(resumed_sums_message(progress, steps.sums.names))
            if progress.pass_rows is None:  # the pass's first batch
                progress = dataclasses.replace(progress, pass_rows=group[0].size)
            before = progress.step
            self.epoch_examples += sum(placed.n for placed in group) * examples
            compiles = clock.compile_count
            if len(group) > 1 and len(group) == k:
                assert steps.train_many is not None
                batch, weight, total = self.preparer.pipeline.stack(group)
                clock.switch("step")
                args = (leaves, *epoch_sums, batch, weight, total)
                leaves, epoch_sums, sums = steps.train_many(*args)
                clock.switch("host")
                if clock.compile_count != compiles:
                    self.compiled(f"train step x{k}", compiles, args)
                progress = progress.stepped(epoch_sums, k)
                self.move_to(leaves, progress)
                rows = [(sums, i) for i in range(k)]
            else:
                rows = []
                for placed in group:
                    clock.switch("step")
                    args = (
                        leaves,
                        *epoch_sums,
                        placed.leaves,
                        placed.weight,
                        placed.total,
                    )
                    leaves, epoch_sums, sums = steps.train(*args)
                    clock.switch("host")
                    if clock.compile_count != compiles:
                        self.compiled("train step", compiles, args)
                        compiles = clock.compile_count
                    progress = progress.stepped(epoch_sums)
                    self.move_to(leaves, progress)
                    rows.append((sums, None))
            if progress.step // sync_every > before // sync_every:
                self.sync(epoch_sums)
            # An evaluation after this call's last step comes before that
            # step's hooks: a checkpoint saved there holds it.
            evaluates = every is not None and progress.step % every == 0
            if callbacks.step_hooks or evaluates:
                layout = self.compiler.step_layout(steps)
                last = len(group) - 1
                for i, (placed, row) in enumerate(zip(group, rows, strict=True)):
                    if i == last and evaluates:
                        self.evaluation()
                    if not callbacks.step_hooks:
                        continue
                    # The slices are equal but for the last batch of a pass,
                    # at most one example apart.
                    info = self.info(
                        StepSums(row[0], layout, row[1]),
                        examples=placed.n * examples,
                        step=before + i + 1,
                        last_in_call=i == last,
                    )
                    callbacks.step_end(info)
            if self.stopping() or self.progress.plan.done(self.progress.step, None):
                return

    def sync(self, epoch_sums: EpochSums) -> None:
        """Wait for the device as far as the previous sync point (a bounded
        in-flight window that never drains: the steps since then keep the
        device busy meanwhile); surface a bad step up to there."""
        flags, self.waiting = self.waiting, epoch_sums.flags
        done, self.waiting_step = self.waiting_step, self.progress.step
        # Collected while the device runs the steps since the last point.
        self.collector.at_sync()
        if flags is None:
            return
        clock = self.clock
        clock.switch("step")
        if self.settings.nan_policy == "raise":
            fetched = jax.device_get(flags)
            clock.switch("host")
            self.raise_if_nonfinite(fetched)
        else:
            jax.block_until_ready(flags)
            clock.switch("host")
        self.slow.waited(done, self.progress.step)

    def compiled(self, kind: str, since: int, args: tuple[Any, ...]) -> None:
        """A train call compiled (JAX's compile events since `since` on the
        clock): name those compiles by `kind` and the batch's types, and
        tell the recompile alarm what the call's arguments were (their
        types and shardings: readable after donation, no device value)."""
        leaves, sums, weight, total = args[0], args[1:-3], args[-2], args[-1]
        names = leaf_names(self.compiler.layout.treedef)
        batch = jax.tree.leaves(args[-3])
        spec = " ".join(_short(x) for x in batch)
        self.clock.name_compiles(since, f"{kind}, batch {spec}")
        named = [*zip(names, leaves, strict=True)]
        named += [
            (f"the epoch's {f}", x)
            for f, x in zip(EpochSums._fields, sums, strict=True)
        ]
        # By their paths in the user's batch: batch['x'], batch[1], ...
        batch_names = self.preparer.batch_names
        if batch_names is None or len(batch_names) != len(batch):
            batch_names = [f"the batch's leaf {i}" for i in range(len(batch))]
        named += [*zip(batch_names, batch, strict=True)]
        named += [("the batch's example weights", weight)]
        named += [("the batch's total weight", total)]
        self.recompiles.compiled(
            kind, [(name, _typed(x), _sharding(x)) for name, x in named]
        )

    def build_steps(self) -> None:
        """Build the steps from the data's first batch without training on it
        or moving the data on: reading an epoch's sums takes the steps' own
        readers, and a run resumed at its epoch's last step has no batch
        left to build them from."""
        data = self.data
        state = data.state_dict() if isinstance(data, Resumable) else None
        try:
            first = next(iter(data), None)
        finally:
            if isinstance(data, Resumable):
                data.load_state_dict(state)
        if first is not None:
            preparer = self.preparer
            preparer.steps = preparer.build(preparer.split(first), "batch 0")

    def epoch_logs(self, epoch_sums: Any) -> HostMetrics:
        """The epoch's means from its sums, fetched (each divided once by the
        epoch's total weight)."""
        self.raise_if_nonfinite(epoch_sums.flags)
        average = self.preparer.built().sums.means(epoch_sums.sums)
        logs = {k: average[k] for k in ["loss", *sorted(set(average) - {"loss"})]}
        dynamic = self.compiler.parts.precision.loss_scale == "dynamic"
        if self.settings.nan_policy == "skip" or dynamic:  # overflows skip too
            logs["skipped_steps"] = float(epoch_sums.flags[FLAGS.index("skipped")])
        scale = self.compiler.layout.unflatten(self.slot.run.leaves).loss_scale
        if scale is not None:  # dynamic: the scale the next step will use
            logs["loss_scale"] = float(to_host(scale.scale))
        return logs

    def raise_if_nonfinite(self, flags: Any) -> None:
        """Raise FloatingPointError if a step had a non-finite gradient; the
        progress goes back to that step (the state was frozen there)."""
        _, step, leaf = (int(flag) for flag in flags)
        if step >= 0:
            run = self.slot.run
            self.slot.run = run.replace(
                progress=dataclasses.replace(run.progress, step=step)
            )
            model = self.compiler.layout.unflatten(run.leaves).model
            raise nonfinite_error(step, leaf, model)


def _typed(x: Any) -> str:
    """An argument leaf's type as JAX keys a compile by it, written the same
    for a NumPy and a JAX array: ``~`` marks a weak type (``~float32[]``)."""
    return str(jax.typeof(x))


def _short(x: Any) -> str:
    """A batch leaf's type in short, as JAX writes it: ``f32[64,784]``."""
    return jax.typeof(x).str_short(short_dtypes=True)


def _sharding(x: Any) -> Any:
    return x.sharding if isinstance(x, jax.Array) else None


def leaf_names(treedef: Any) -> list[str]:
    """The path of each leaf of a state's structure, e.g.
    ``state.opt_state[0].hyperparams['learning_rate']``."""
    numbered = jax.tree.unflatten(treedef, range(treedef.num_leaves))
    paths = jax.tree_util.tree_flatten_with_path(numbered)[0]
    return [f"state{jax.tree_util.keystr(path)}" for path, _ in paths]


def plan(data: Iterable[Any], progress: RunProgress) -> tuple[int | None, int | None]:
    """A run's epochs, and its steps from its start, where known up front."""
    run: RunPlan = progress.plan
    per_epoch = len(data) if isinstance(data, Sized) else None
    total = None
    if run.epochs is not None and per_epoch is not None:
        total = run.start_step + run.epochs * per_epoch
    if run.steps is not None:
        end = run.start_step + run.steps
        total = end if total is None else min(total, end)
    step = progress.step
    return run.epochs, None if total is None else max(total, step) - run.start_step


def resumed_sums_message(progress: RunProgress, names: tuple[str, ...]) -> str:
    """Why a run cannot go on summing the epoch it was resumed in."""
    return (
        f"resume: the checkpoint was saved in the middle of epoch {progress.epoch} "
        f"with running sums of {list(progress.sum_names)}, but this trainer's "
        f"steps sum {list(names)}; resume with the loss and metrics the run "
        "was saved with (or from a checkpoint saved at an epoch's end)"
    )
