"""The fit planner (issue 43) on a `Stacked` transformer of ~20 M parameters
on 8 devices: how many candidates it compiles and how long it takes, the
chosen layout's state bytes against those a trainer allocates under it, a
budget 20% below the choice's peak, and predicted against measured step
time (and, on a GPU, peak memory) for the fastest candidates that fit.

On a CPU host the devices are 8 fake ones sharing its cores, and the cost
model is nominal: the times rank candidates, and the measured column says
whether the ranking holds there. On a GPU (``bash benchmarks/gpu.sh``) the
predictions are in seconds and bytes, and their error is the guide's
"measured error".

Measured step time is a step's, not a ``fit`` call's: the slope of a fit's
time over its steps (a fit of ``1 + --steps`` steps less a fit of one, over
``--steps``; the median of three), so that what a fit costs once (its
start, its callbacks' first and last calls, the wait for its last step)
cancels. ``--measure K`` also has the plan run and time its K fastest
predicted (``px.plan(measure=K)``: its compiled programs, a few steps on
random arrays) and choose by their time; both measured columns are printed.

Run: ``python benchmarks/plan.py [--budget 200MiB] [--compare 3] [--measure 0]
[--out F]``
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax


ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' shared transformer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget", default=None, help="per device (CPU: 200MiB)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="timed steps each")
    parser.add_argument("--compare", type=int, default=3, help="candidates run")
    parser.add_argument(
        "--measure", type=int, default=0, help="the plan's own measure= (K run)"
    )
    parser.add_argument("--out", default=None, help="write the numbers as JSON")
    args = parser.parse_args()

    import phalanx as px

    px.fake_cpu_devices(8)  # a CPU-only host: 8 devices (no effect on accelerators)
    import equinox as eqx
    import jax.numpy as jnp
    import numpy as np
    import optax

    from phalanx._plan._space import with_remat
    from stacked_transformer import RULES, Transformer

    def make() -> Transformer:
        return Transformer(
            vocab=256, width=args.width, layers=args.layers, heads=8,
            key=jax.random.key(0),
        )  # fmt: skip

    def loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(-1)

    shapes = jax.ShapeDtypeStruct((args.batch, args.seq), jnp.int32)
    batch = (shapes, shapes)
    budget = args.budget or ("200MiB" if jax.default_backend() == "cpu" else None)
    space = px.PlanSpace(rules=RULES)
    model = eqx.filter_eval_shape(make)
    params = sum(x.size for x in jax.tree.leaves(model) if hasattr(x, "size"))
    began = time.perf_counter()
    plan = px.plan(
        make, optax.adam(1e-3), batch, budget=budget, space=space, loss=loss,
        measure=args.measure, progress=True,
    )  # fmt: skip
    took = time.perf_counter() - began
    print(plan)
    print(f"{params / 1e6:.1f} M parameters; {plan.compiled} compiled in {took:.1f} s")
    results: dict = {
        "parameters": params,
        "compiled": plan.compiled,
        "reused": plan.reused,
        "seconds": took,
        "by_measurement": plan.by_measurement,
    }
    if plan.choice is None:
        print(plan.nothing_fits())
        return

    def run(candidate) -> tuple[float, float, int | None]:
        """Train `candidate` for a few steps: its state bytes on the fullest
        device, its step time (the median of three slopes: a fit of 1 +
        steps less a fit of one, over steps), the device's peak bytes so far
        (the process' high-water mark: this run's or an earlier one's;
        `plan_accuracy.py` measures each peak in a process of its own)."""
        strategy = candidate.strategy(space, jax.devices()[: plan.devices])
        # The candidate's own remat (the model's default is not it).
        trainer = px.DataParallelTrainer(
            with_remat(make(), candidate.remat), optax.adam(1e-3), loss=loss,
            strategy=strategy, progress=False,
        )  # fmt: skip
        held: dict = {}
        for leaf in jax.tree.leaves(eqx.filter(trainer.state, eqx.is_array)):
            for shard in leaf.addressable_shards:
                held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
        tokens = np.random.default_rng(0).integers(0, 256, (args.batch, args.seq))
        data = [(tokens.astype(np.int32), tokens.astype(np.int32))]
        trainer.fit(data * 2)  # compile and warm up
        times = []
        for _ in range(3):
            start = time.perf_counter()
            trainer.fit(data)
            one = time.perf_counter() - start
            start = time.perf_counter()
            trainer.fit(data * (1 + args.steps))
            many = time.perf_counter() - start
            times.append((many - one) / args.steps)
        stats = jax.devices()[0].memory_stats() or {}
        return (
            max(held.values()),
            statistics.median(times),
            stats.get("peak_bytes_in_use"),
        )

    choice = plan.choice
    assert choice.bounds is not None and choice.measured is not None
    allocated, _, _ = run(choice.candidate)
    ratio = allocated / choice.bounds.state
    print(
        f"chosen {choice.candidate.describe()}: state {choice.bounds.state} bytes "
        f"planned, {allocated} allocated on the fullest device ({ratio:.4f})"
    )
    results["state"] = {"planned": choice.bounds.state, "allocated": allocated}

    peak = choice.measured.peak
    lower = int(peak * 0.8 / (1 - plan.margin))
    began = time.perf_counter()
    tighter = px.plan(
        make, optax.adam(1e-3), batch, budget=lower, space=space, loss=loss
    )
    took = time.perf_counter() - began
    said = (
        tighter.nothing_fits()
        if tighter.choice is None
        else f"chose {tighter.choice.candidate.describe()}"
    )
    print(
        f"budget {lower} (20% below the choice's peak {peak}): {said} "
        f"(compiled {tighter.compiled}, reused {tighter.reused}, in {took:.1f} s)"
    )
    results["tighter"] = {
        "budget": lower,
        "said": said,
        "compiled": tighter.compiled,
        "reused": tighter.reused,
        "seconds": took,
    }

    fitting = sorted(
        (r for r in plan.rows if r.status == "fits" and r.measured is not None),
        key=lambda r: r.measured.seconds,  # pyright: ignore[reportOptionalMemberAccess]
    )[: args.compare]
    compared = []
    for row in fitting:
        assert row.measured is not None
        _, seconds, device_peak = run(row.candidate)
        compared.append(
            {
                "candidate": row.candidate.describe(),
                "predicted_s": row.measured.seconds,
                "measured_s": seconds,
                "plan_measured_s": row.timed,
                "predicted_peak": row.measured.peak,
                "measured_peak_so_far": device_peak,
            }
        )
        by_plan = "" if row.timed is None else f" (the plan's {row.timed:.4g})"
        print(
            f"{row.candidate.describe():<45} predicted {row.measured.seconds:.4g} "
            f"measured {seconds:.4g} s{by_plan}"
            + (
                ""
                if device_peak is None
                else f", peak so far {device_peak} vs {row.measured.peak} bytes"
            )
        )
    results["compared"] = compared
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
