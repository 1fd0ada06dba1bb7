"""phalanx on one accelerator chip against hand-written `jax.jit` loops of the
same models (issue 53), one part a call, each writing ``<part>.json``:

- ``cells``: three MLPs with adam, batches already on the device: 16-16-4
  (batch 64) and 784-256-128-10 (batch 256), where the host's work a step
  is the speed, and 1024-4096×3-10 (batch 4096, a 7 ms step on a TPU v5e),
  where the chip's is. Sides: the hand loop (`references.py`'s ``"jit"``),
  the default trainer (``nan_policy="raise"``: on a TPU the held guard,
  ``phalanx/_engine/_held.py``), ``steps_per_call=8``, the default with the
  gated guard (each step deciding whether its own update lands, as on a
  CPU), and on the wide MLP ``nan_policy="off"`` and ``"skip"``. Rounds alternate the
  sides (each a fit of the cell's steps: 1,000);
  each side's ratio is the median over the rounds of the hand loop's time ÷
  its time for the same steps.
- ``steps``: ``steps_per_call`` 1, 8 and 32 on the tiny MLP: steps a second,
  the compiled call's memory as XLA plans it (its temporaries; its
  arguments, which hold the k batches; its code) and the first fit's time.
- ``nan``: a NaN gradient planted at step 3 (a loss of sqrt(-1) for one
  batch): ``"raise"`` must stop naming step 3 with the state of step 2 (the
  same as a run of the first 3 batches), ``"skip"`` must skip and count it.
- ``lm``: `examples/language_model.py`'s `Decoder` at GPT-2 small (124 M
  parameters, 1,024 tokens, batch 8, bf16), and the tests' `Stacked`
  transformer (`tests/stacked_transformer.py`, 19 M, 512 tokens, batch
  32, bf16): phalanx's `fit` against a hand-written loop of the same model
  and loss (parameters cast to bfloat16 in the step, float32 master
  weights, adamw), and the MFU of each: model FLOPs (`flops_per_token`,
  PaLM's count: 6 a weight a token, causal attention half its scores; the
  tests' model computes its whole score matrix, so all of it counts) ÷ time
  ÷ the chip's peak (`phalanx`'s peak table).

Run: ``python benchmarks/tpu.py PART [--out DIR]`` (``bash benchmarks/tpu.sh``
runs every part on the lent TPU, and issue 56's two, scripts of their own:
``attention``, `benchmarks/attention.py`'s splash kernel against XLA's
attention, and ``long``, `examples/long_sequence.py`'s decoder at 16k to 64k
tokens).
"""

import argparse
import functools as ft
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import phalanx as px
import references
from phalanx._engine.step import _held
from phalanx._telemetry._peak_flops import peak_flops


ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests")]
CELLS = {  # name: (size, batch, steps a window)
    "wide": ("wide", 4096, 1000),
    "tiny": ("tiny", 64, 1000),
    "mlp": ("mlp", 256, 1000),
}
references.SIZES["wide"] = references.ModelSize(1024, (4096, 4096, 4096), 10)


def cells(args: argparse.Namespace) -> dict[str, Any]:
    """Each cell's sides, timed in alternating rounds."""
    out: dict[str, Any] = {}
    for name in args.cells.split(","):
        size, batch, steps = CELLS[name]
        references.use_size(size)
        x, y = _batch(batch)
        sides: dict[str, Callable[[int], None]] = {"hand": _hand(x, y)}
        sides["default"] = _fit(x, y)
        sides["steps_per_call=8"] = _fit(x, y, steps_per_call=8)
        sides["gated guard"] = _gated(x, y)
        if name == "wide":
            sides['nan_policy="off"'] = _fit(x, y, nan_policy="off")
            sides['nan_policy="skip"'] = _fit(x, y, nan_policy="skip")
        out[name] = _rounds(sides, steps, args.rounds)
        out[name]["batch"] = batch
        out[name]["model"] = references.SIZE.describe()
        print(name, {k: v for k, v in out[name].items() if k.endswith("ratio")})
        _write(args, "cells", out)
    return out


def _batch(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    size = references.SIZE
    x = rng.normal(size=(batch, size.inputs)).astype(np.float32)
    return x, rng.integers(0, size.classes, batch).astype(np.int32)


def _hand(x: np.ndarray, y: np.ndarray) -> Callable[[int], None]:
    reference = references.make_reference("jit", jax.devices()[:1], len(x), 1)
    placed = reference.place(x, y)

    def run(steps: int) -> None:
        for _ in range(steps):
            reference.step(placed)
        reference.block()

    return run


def _fit(x: np.ndarray, y: np.ndarray, **kwargs: Any) -> Callable[[int], None]:
    trainer = px.DataParallelTrainer(
        references.make_model(), references.make_optimizer(), progress=False, **kwargs
    )
    placed = jax.device_put((x, y), trainer.strategy.batch_sharding)
    trainer.fit([placed] * 8, steps=8)

    def run(steps: int) -> None:
        trainer.fit([placed] * steps, steps=steps)
        jax.block_until_ready(trainer.state)

    return run


def _gated(x: np.ndarray, y: np.ndarray) -> Callable[[int], None]:
    """The default trainer with the guard of a CPU (each step decides
    whether its own update lands) instead of the held one."""
    held = _held.HOLD
    _held.HOLD = False
    try:
        return _fit(x, y)
    finally:
        _held.HOLD = held


def _rounds(
    sides: dict[str, Callable[[int], None]], steps: int, rounds: int
) -> dict[str, Any]:
    """Seconds a step of each side, `rounds` rounds (the order turned each
    round), and each side's median ratio to the hand loop's round."""
    for run in sides.values():
        run(max(2, steps // 10))  # warm
    times: dict[str, list[float]] = {name: [] for name in sides}
    order = list(sides)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            sides[name](steps)
            times[name].append((time.perf_counter() - start) / steps)
    out: dict[str, Any] = {"steps_per_window": steps}
    for name, seconds in times.items():
        out[name] = {"ms": statistics.median(seconds) * 1e3, "rounds_s": seconds}
        ratios = [h / s for h, s in zip(times["hand"], seconds, strict=True)]
        out[name + " ratio"] = statistics.median(ratios)
    return out


def steps(args: argparse.Namespace) -> dict[str, Any]:
    """`steps_per_call` on the tiny MLP: speed, compiled memory and compile
    time of the call."""
    references.use_size("tiny")
    x, y = _batch(64)
    out: dict[str, Any] = {}
    for k in (1, 8, 32):
        trainer = px.DataParallelTrainer(
            references.make_model(),
            references.make_optimizer(),
            progress=False,
            steps_per_call=k,
        )
        placed = jax.device_put((x, y), trainer.strategy.batch_sharding)
        start = time.perf_counter()
        trainer.fit([placed] * k, steps=k)
        first = time.perf_counter() - start
        # The compiled call the fit runs (a benchmark may read the trainer's
        # programs; users read `trainer.summary(batch)`).
        program = trainer._parts.programs.first  # pyright: ignore[reportPrivateUsage]
        assert program is not None
        call = program.train_many if k > 1 else program.train
        memory = call.memory_analysis()  # pyright: ignore[reportAttributeAccessIssue]
        n = 2048
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            trainer.fit([placed] * n, steps=n)
            jax.block_until_ready(trainer.state)
            runs.append((time.perf_counter() - start) / n)
        out[str(k)] = {
            "steps_per_s": 1 / statistics.median(runs),
            "first_fit_s": first,
            "memory_bytes": _planned(memory),
            "temporary_bytes": int(memory.temp_size_in_bytes),
            "argument_bytes": int(memory.argument_size_in_bytes),
            "code_bytes": int(memory.generated_code_size_in_bytes),
        }
        print("steps_per_call", k, out[str(k)])
    one = out["1"]
    for k in ("8", "32"):
        out[k]["speedup"] = out[k]["steps_per_s"] / one["steps_per_s"]
        # The compiled call's own memory: its temporaries (the k batches it
        # is handed are its arguments, k times one step's by construction).
        out[k]["temporary_ratio"] = out[k]["temporary_bytes"] / one["temporary_bytes"]
    _write(args, "steps", out)
    return out


def _planned(memory: Any) -> int:
    """The bytes XLA plans for a compiled call on its device."""
    return int(
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )


def nan(args: argparse.Namespace) -> dict[str, Any]:
    """A NaN gradient planted at step 3, under "raise" and "skip"."""
    references.use_size("tiny")
    x, y = _batch(64)
    good = [(x, y)] * 6
    bad = (x, np.full_like(y, -1))  # sqrt(-1): finite inputs, a NaN gradient

    def loss(outputs: jax.Array, targets: jax.Array) -> jax.Array:
        return jnp.sum(outputs**2, -1) * jnp.sqrt(targets.astype(jnp.float32))

    def trainer(policy: str) -> px.DataParallelTrainer:
        return px.DataParallelTrainer(
            references.make_model(),
            optax.adam(1e-2),
            loss=loss,
            metrics=(),
            nan_policy=policy,  # pyright: ignore[reportArgumentType]
            progress=False,
        )

    clean = trainer("raise")
    clean.fit(good[:3])
    raised = trainer("raise")
    message = ""
    try:
        raised.fit([*good[:3], bad, *good[3:]])
    except FloatingPointError as error:
        message = str(error)
    same = _params_equal(raised.model, clean.model)
    skipped = trainer("skip")
    skipped.fit([*good[:3], bad, *good[3:]])
    out = {
        "raise_message": message,
        "raise_names_step_3": "at step 3" in message,
        "raise_state_step": int(raised.state.step),
        "raise_state_equals_3_clean_steps": same,
        "skip_skipped_steps": skipped.history["skipped_steps"][-1],
        "skip_state_step": int(skipped.state.step),
    }
    print(out)
    _write(args, "nan", out)
    return out


def _params_equal(a: eqx.Module, b: eqx.Module) -> bool:
    leaves = [jax.tree.leaves(eqx.filter(m, eqx.is_inexact_array)) for m in (a, b)]
    pairs = zip(*leaves, strict=True)
    return all(bool(jnp.array_equal(p, q)) for p, q in pairs)


def lm(args: argparse.Namespace) -> dict[str, Any]:
    """GPT-2 small and the tests' transformer: phalanx against a hand loop,
    and each one's MFU."""
    import language_model as example
    from stacked_transformer import Transformer

    peak = peak_flops(jax.devices()[0].device_kind, np.dtype(jnp.bfloat16)) or 197e12
    out: dict[str, Any] = {"peak_flops": peak}
    size = dict(example.SIZES[args.lm_size])
    batch, seq, vocab = args.lm_batch, size["seq"], size["vocab"]
    models = {
        "gpt2": (
            lambda: example.Decoder(**size, key=jax.random.key(0)),
            batch, seq, vocab, example.flops_per_token(**size) * batch * seq,
        ),
        "tests_transformer": (
            lambda: Transformer(vocab=256, width=512, layers=6, heads=8,
                                key=jax.random.key(0)),
            32, 512, 256, 6 * 32 * 512 * (12 * 6 * 512**2 + 512 * 256)
            + 12 * 32 * 6 * 512 * 512**2,
        ),
    }  # fmt: skip
    for name in args.lm_models.split(","):
        make, b, s, v, flops = models[name]
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, v, (b, s + 1)).astype(np.int32)
        data = (tokens[:, :-1], tokens[:, 1:])
        sides = {"hand": _hand_lm(make(), data), "phalanx": _fit_lm(make(), data)}
        cell = _rounds(sides, args.lm_steps, args.rounds)
        for side in ("hand", "phalanx"):
            cell[side]["mfu"] = flops / (cell[side]["ms"] / 1e3) / peak
        cell.update(batch=b, seq=s, model_flops_per_step=flops)
        out[name] = cell
        print(name, {k: cell[k] for k in ("hand", "phalanx", "phalanx ratio")})
        _write(args, "lm", out)
        jax.clear_caches()
    return out


def _lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return per_token.mean(-1)


def _lm_optimizer() -> optax.GradientTransformation:
    return optax.adamw(3e-4, weight_decay=0.1)


def _hand_lm(model: eqx.Module, data: tuple[np.ndarray, ...]) -> Callable[[int], None]:
    """A hand-written bf16 loop: float32 state, the parameters cast to
    bfloat16 in the step, the logits to float32 for the loss."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    optimizer = _lm_optimizer()

    def loss(params: Any, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        half = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
        logits = jax.vmap(eqx.combine(half, static))(tokens).astype(jnp.float32)
        return _lm_loss(logits, targets).mean()

    @ft.partial(jax.jit, donate_argnums=(0, 1))
    def step(params: Any, opt_state: Any, tokens: jax.Array, targets: jax.Array):
        value, grads = jax.value_and_grad(loss)(params, tokens, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    state = [params, optimizer.init(params)]
    tokens, targets = jax.device_put(data)

    def run(steps: int) -> None:
        for _ in range(steps):
            state[0], state[1], _ = step(state[0], state[1], tokens, targets)
        jax.block_until_ready(state[0])

    return run


def _fit_lm(model: eqx.Module, data: tuple[np.ndarray, ...]) -> Callable[[int], None]:
    trainer = px.DataParallelTrainer(
        model,
        _lm_optimizer(),
        loss=_lm_loss,
        metrics=(),
        precision="bf16",
        progress=False,
    )
    placed = jax.device_put(data, trainer.strategy.batch_sharding)

    def run(steps: int) -> None:
        trainer.fit([placed] * steps, steps=steps)
        jax.block_until_ready(trainer.state)

    return run


def _write(args: argparse.Namespace, part: str, result: dict[str, Any]) -> None:
    record = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    path = pathlib.Path(args.out) / f"{part}.json"
    path.write_text(json.dumps(record | result, indent=1, default=str))


PARTS = {"cells": cells, "steps": steps, "nan": nan, "lm": lm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("part", choices=sorted(PARTS))
    parser.add_argument("--out", default="/tmp/phalanx-tpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lm-batch", type=int, default=8)
    parser.add_argument("--lm-steps", type=int, default=10)
    parser.add_argument("--cells", default=",".join(CELLS), help="of the cells part")
    parser.add_argument("--lm-models", default="gpt2,tests_transformer")
    parser.add_argument("--lm-size", default="gpt2", help="the Decoder's size")
    args = parser.parse_args()
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    PARTS[args.part](args)


if __name__ == "__main__":
    main()
