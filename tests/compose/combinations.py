"""The composition suite's design (invariant 8): the options a user combines,
the all-pairs rows over them, and one trainer built from a row.

Every row trains the same tiny model (a two-layer network on 8 features, 4
classes) on the same synthetic batches: 3 epochs of 6 batches of 16 (18
steps; 16 is a multiple of 8 devices × 2 microbatches, so no set-up pads),
evaluated on 32 held-out examples. The optimizer is always
``optax.inject_hyperparams(optax.adam)`` on a warmup-cosine schedule (the
plateau option adds only the callback), so that a row with and one without
the plateau differ by what the plateau does and nothing else.
"""

import dataclasses
import itertools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from allpairspy import AllPairs
from typing_extensions import override

import phalanx as px
from phalanx.strategies._registry import Options, build as build_strategy, registered


def strategy_names() -> tuple[str, ...]:
    """Every strategy of the registry (read when asked: a registered one is
    in the design), then two microbatches of the first."""
    return (*(entry.name for entry in registered()), "accumulating")


# Each option's values, the first one "off". The strategies run on all 8
# devices; the reference (one device) is not among them.
OPTIONS: dict[str, tuple[Any, ...]] = {
    "strategy": strategy_names(),
    "precision": ("fp32", "bf16"),
    "steps_per_call": (1, 3),
    "ema": (False, True),
    "groups": (False, True),
    "f1": (False, True),
    "eval_every": (None, 3),
    "timeline": (False, True),
    "plateau": (False, True),
    "resume": (False, True),
}

FEATURES, WIDTH, CLASSES = 8, 16, 4
BATCH, BATCHES, EPOCHS = 16, 6, 3
EVAL_EXAMPLES = 2 * BATCH
STEPS = BATCHES * EPOCHS
DECAY = 0.9  # the moving average's: far enough from 1 to move in 18 steps
FACTOR = 0.5  # the plateau's
# The killed run stops at this step (a callback raising, as a crash would),
# in the third epoch, after the plateau's first reduction (at the second
# epoch's end, step 12): the resumed run must go on at the reduced rate. Its
# newest save is step 14 with one step a call (mid-epoch, between the
# evaluations at 12 and 15 of eval_every=3), step 15 with three (14 is
# reached inside the call 13-15, saved where the call ends).
CRASH, SAVE_EVERY = 16, 7
# Values that measure wall time: their names are compared, never their values.
TIMED = ("time/", "goodput")


def schedule() -> optax.Schedule:
    """Warmup-cosine: 0 -> 2e-2 over 3 steps, down to 2e-3 at step 18."""
    return optax.warmup_cosine_decay_schedule(0.0, 2e-2, 3, STEPS, end_value=2e-3)


def head_schedule() -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, 5e-2, 3, STEPS)


@dataclasses.dataclass(frozen=True)
class Combination:
    """One row of the design: a value of every option in `OPTIONS`."""

    strategy: str
    precision: str
    steps_per_call: int
    ema: bool
    groups: bool
    f1: bool
    eval_every: int | None
    timeline: bool
    plateau: bool
    resume: bool

    @property
    def name(self) -> str:
        """A test id, e.g. ``mesh-bf16-spc3-ema-groups-f1-eval3-timeline``."""
        parts = [self.strategy, self.precision, f"spc{self.steps_per_call}"]
        parts += [
            flag
            for flag in ("ema", "groups", "f1", "timeline", "plateau", "resume")
            if getattr(self, flag)
        ]
        if self.eval_every is not None:
            parts.append(f"eval{self.eval_every}")
        return "-".join(parts)

    def reference(self) -> "Combination":
        """The same run on one device: the options that change what is
        computed or logged kept, how it is run (strategy, steps a call, a
        kill) dropped. Rows differing only in those share it."""
        return dataclasses.replace(
            self, strategy="one_device", steps_per_call=1, resume=False
        )

    def with_precision(self, precision: str) -> "Combination":
        return dataclasses.replace(self, precision=precision)

    def without_plateau(self) -> "Combination":
        return dataclasses.replace(self, plateau=False)


def rows() -> list[Combination]:
    """The all-pairs rows (allpairspy's greedy cover, deterministic)."""
    return [Combination(*row) for row in AllPairs(list(OPTIONS.values()))]


def uncovered(design: list[Combination]) -> list[tuple[str, Any, str, Any]]:
    """The pairs of option values no row of `design` holds."""
    seen = {
        (a, getattr(row, a), b, getattr(row, b))
        for row in design
        for a, b in itertools.combinations(OPTIONS, 2)
    }
    return [
        (a, va, b, vb)
        for a, b in itertools.combinations(OPTIONS, 2)
        for va in OPTIONS[a]
        for vb in OPTIONS[b]
        if (a, va, b, vb) not in seen
    ]


def all_pairs() -> int:
    """How many pairs of option values there are."""
    return sum(
        len(OPTIONS[a]) * len(OPTIONS[b]) for a, b in itertools.combinations(OPTIONS, 2)
    )


# Tensor parallelism by rules: the hidden layer split over tensor (its rows)
# and fsdp (its columns); the head's columns over both.
RULES = [
    (r"body\.weight", ("tensor", "fsdp")),
    (r"body\.bias", ("tensor",)),
    (r"head\.weight", (None, ("fsdp", "tensor"))),
]


# The strategies this design sizes for its model; any other registered one
# is built as the registry builds it.
SIZED = {
    # min_size 17: the weights (128 and 64) split, the biases (16, 4) whole.
    "fsdp": Options(min_size=lambda n: 17),
}


def strategy(name: str) -> px.Strategy:
    """The strategy of a row; ``one_device``: the reference's."""
    if name == "one_device":
        return px.ShardingStrategy(jax.devices()[:1])
    if name == "accumulating":
        return px.AccumulatingStrategy(strategy(registered()[0].name), 2)
    if name == "mesh":  # tensor parallelism by RULES, which no option carries
        return px.MeshStrategy(data=2, fsdp=2, tensor=2, rules=RULES, min_size=16)
    return build_strategy(name, 8, SIZED.get(name, Options()))


class Net(eqx.Module):
    """8 features -> 16 (tanh) -> 4 logits, in two named parts (the groups).

    Smooth: under relu, a pre-activation within bf16's rounding of 0 (one
    was 0.002, from terms of 0.4) passes an example's gradient in one run
    and not in the other, a jump no tolerance of rounding allows for."""

    body: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        one, two = jax.random.split(key)
        self.body = eqx.nn.Linear(FEATURES, WIDTH, key=one)
        self.head = eqx.nn.Linear(WIDTH, CLASSES, key=two)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(jnp.tanh(self.body(x)))


def data() -> tuple[list[tuple[np.ndarray, np.ndarray]], list[tuple[Any, Any]]]:
    """The training batches and the evaluation batches: classes of a fixed
    linear map of the features, with noise (learnable, not at once)."""
    rng = np.random.default_rng(41)
    mix = rng.normal(size=(FEATURES, CLASSES))
    x = rng.normal(size=(BATCH * BATCHES + EVAL_EXAMPLES, FEATURES)).astype(np.float32)
    y = np.argmax(x @ mix + rng.normal(size=(len(x), CLASSES)), -1).astype(np.int32)
    pairs = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]
    return pairs[:BATCHES], pairs[BATCHES:]


class ComposeTrainer(px.DataParallelTrainer[Net]):
    """The trainer with a row's hooks: two parameter groups, and F1 (a
    dataset-level metric, summed over every example) beside accuracy."""

    def __init__(self, *args: Any, groups: bool, f1: bool, **kwargs: Any):
        self.groups, self.f1 = groups, f1
        super().__init__(*args, **kwargs)

    @override
    def param_groups(self, model: Net) -> Any:
        if not self.groups:
            return None
        return eqx.tree_at(lambda m: (m.body, m.head), model, ("body", "head"))

    @override
    def metrics(self, outputs: Any, targets: Any) -> Any:
        metrics = dict(super().metrics(outputs, targets))
        if self.f1:
            metrics["f1"] = px.metrics.f1(outputs, targets, num_classes=CLASSES)
        return metrics


def optimizer(groups: bool) -> Any:
    """Adam on the schedule, its rate injected; with groups, the head trains
    with SGD and momentum on a schedule of its own.

    Adam's ``eps`` is 1e-2, near this model's gradient entries (1e-3 to
    1e-1): with the default 1e-8 its update is the gradient's direction
    only, so a gradient scaled wrongly under a strategy leaves the
    parameters as one device's (a gradient 1% too large did, in the rows
    without groups), and an entry that is zero up to rounding moves by the
    rate in rounding's direction. With 1e-2, 1% too large fails every
    float32 row, 10% every row.
    """
    adam = optax.inject_hyperparams(optax.adam)(learning_rate=schedule(), eps=1e-2)
    if not groups:
        return adam
    return {"body": adam, "head": optax.sgd(head_schedule(), momentum=0.9)}


def plateau() -> px.callbacks.ReduceLROnPlateau:
    """A plateau that reduces at every epoch end after the first: no value
    improves by more than ``min_delta`` (1e9), and the patience is one, so
    the reductions do not hang on rounding in the losses."""
    return px.callbacks.ReduceLROnPlateau(
        "loss", factor=FACTOR, patience=1, min_delta=1e9
    )


def build(combo: Combination, callbacks: list[px.Callback]) -> ComposeTrainer:
    """A new trainer for `combo`, its option callbacks after `callbacks`: a
    plateau and a timeline placed after the logger among them, whose
    columns must reach it anyway (issue 41, item 4)."""
    extra: list[px.Callback] = []
    if combo.plateau:
        extra.append(plateau())
    if combo.timeline:
        extra.append(px.callbacks.Timeline(table=False))
    return ComposeTrainer(
        Net(jax.random.key(0)),
        optimizer(combo.groups),
        groups=combo.groups,
        f1=combo.f1,
        strategy=strategy(combo.strategy),
        precision=combo.precision,
        steps_per_call=combo.steps_per_call,
        ema=DECAY if combo.ema else None,
        callbacks=[*callbacks, *extra],
        progress=False,
    )


def train_keys(combo: Combination) -> set[str]:
    """The names of a step's metrics."""
    return {"loss", "accuracy", *(("f1",) if combo.f1 else ())}


def epoch_keys(combo: Combination) -> set[str]:
    """The names each epoch's metrics must have."""
    train = train_keys(combo)
    keys = set(train)
    if combo.eval_every is None:
        keys |= {f"eval_{name}" for name in train}
    if combo.plateau:
        keys.add("lr")
    if combo.timeline:
        keys |= set(px.callbacks.Timeline().added_metrics())
    return keys


def evaluation_keys(combo: Combination) -> set[str]:
    """The names each evaluation of the history must have."""
    return {"step", "epoch", "eval_loss", "eval_accuracy"} | (
        {"eval_f1"} if combo.f1 else set()
    )
