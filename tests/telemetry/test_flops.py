"""The train step's FLOPs (`trainer.flops_per_step`), counted on its jaxpr:
the MLP 784-256-128-10's against the analytic count of its matrix
multiplies, the same under accumulation (a scan counted times its length),
never a compile added to a fit; `Throughput`'s ``tflops_per_sec`` and
``mfu`` from them; the device peak table; the summary's line."""

import logging
import re

import jax
import numpy as np
import optax
import pytest
from jax import monitoring

import phalanx as px
from phalanx._telemetry._peak_flops import peak_flops


BATCH = 256
WIDTHS = (784, 256, 128, 10)


def analytic(batch: int) -> int:
    """Forward 2·B·Σ fan_in·fan_out; backward twice that, less the first
    layer's input gradient (nothing needs it)."""
    forward = (
        2 * batch * sum(a * b for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=True))
    )
    return 3 * forward - 2 * batch * WIDTHS[0] * WIDTHS[1]


def mlp() -> px.models.MLP:
    return px.models.MLP(784, 10, hidden=(256, 128), key=jax.random.key(0))


def batch(n: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 784)).astype(np.float32)
    return x, rng.integers(0, 10, n).astype(np.int32)


@pytest.mark.parametrize("microbatches", [1, 4])
def test_the_mlp_step_counts_its_matrix_multiplies(microbatches):
    strategy = px.ShardingStrategy()
    if microbatches > 1:
        strategy = px.AccumulatingStrategy(strategy, microbatches)
    trainer = px.DataParallelTrainer(mlp(), optax.adam(1e-3), strategy=strategy)
    assert trainer.flops_per_step() is None  # no batch yet
    flops = trainer.flops_per_step(batch())
    assert flops is not None
    # XLA's cost_analysis() counts a scan's body once: 1/4 of this under
    # accumulation; the jaxpr count multiplies it by its length.
    assert abs(flops.total / analytic(BATCH) - 1) < 0.15
    assert flops.total == analytic(BATCH)  # matrix multiplies only, exactly
    assert (flops.devices, flops.size) == (8, BATCH)
    assert flops.per_device == flops.total / 8
    # A batch of 100 is padded to a multiple of 8 × microbatches: its step
    # counts those examples too.
    small = trainer.flops_per_step(batch(100))
    assert small is not None
    assert (small.size, small.total) == (
        (104, 128)[microbatches > 1],
        analytic(small.size),
    )


def test_counting_adds_no_compile_to_a_fit():
    """A fit with `Throughput` reading the FLOPs at every step compiles what
    the same fit without it does; counting afterwards compiles nothing."""
    requests = []
    # Compiles, whether JAX then finds them in its persistent cache or not.
    names = ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses")

    def on_event(event: str, **kwargs) -> None:
        if event in names:
            requests.append(event)

    def on_duration(event: str, duration_secs: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            requests.append(event)

    monitoring.register_event_listener(on_event)
    monitoring.register_event_duration_secs_listener(on_duration)
    x, y = batch(512)
    counts = []
    try:
        for callbacks in ([], [px.callbacks.Throughput(log_every=1)]):
            trainer = px.DataParallelTrainer(
                mlp(), optax.sgd(1e-2), callbacks=callbacks
            )
            before = len(requests)
            trainer.fit(px.data.ArrayLoader((x, y), BATCH))
            counts.append(len(requests) - before)
        assert counts[0] == counts[1] > 0
        before = len(requests)
        flops = trainer.flops_per_step()
        assert isinstance(flops, px.StepFlops)  # the public type of the count
        assert flops.total == analytic(BATCH)
        other = trainer.flops_per_step(batch(64))
        assert other is not None and other.total == analytic(64)
        shown = trainer.summary().flops
        assert shown is not None and shown.total == analytic(BATCH)
        assert len(requests) == before
    finally:
        monitoring.unregister_event_listener(on_event)
        monitoring.unregister_event_duration_listener(on_duration)


def test_throughput_logs_tflops_and_mfu_against_a_given_peak(caplog):
    peak = 1e9  # a fake peak FLOP/s per device
    given = px.callbacks.Throughput(log_every=1, peak_flops=peak)
    assert given.added_metrics()[-2:] == ("tflops_per_sec", "mfu")
    trainer = px.DataParallelTrainer(mlp(), optax.sgd(1e-2), callbacks=[given])
    x, y = batch(512)
    with caplog.at_level(logging.INFO, logger="phalanx"):
        trainer.fit(px.data.ArrayLoader((x, y), BATCH), epochs=1)
    assert "no mfu" not in caplog.text
    epoch = {name: trainer.history[name][0] for name in trainer.history.names}
    achieved = analytic(BATCH) * epoch["steps_per_sec"]
    assert epoch["tflops_per_sec"] == pytest.approx(achieved / 1e12)
    assert epoch["mfu"] == pytest.approx(achieved / (peak * 8))

    # No peak given, on a CPU: tflops, no mfu, said once over two fits.
    unknown = px.callbacks.Throughput(log_every=1)
    assert "mfu" not in unknown.added_metrics()
    trainer = px.DataParallelTrainer(mlp(), optax.sgd(1e-2), callbacks=[unknown])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="phalanx"):
        for _ in range(2):
            trainer.fit(px.data.ArrayLoader((x, y), BATCH), epochs=1)
    said = [r.getMessage() for r in caplog.records if "no mfu" in r.getMessage()]
    assert said == [
        "Throughput: no peak FLOP/s known for 'cpu' devices computing in "
        "float32, so no mfu; pass Throughput(peak_flops=...) (one device's "
        "FLOP/s) to have it"
    ]
    assert "mfu" not in trainer.history.names
    assert len(trainer.history["tflops_per_sec"]) == 2


@pytest.mark.parametrize("peak", [0.0, -1e12, float("nan"), "989e12"])
def test_a_bad_peak_is_refused_by_name(peak):
    with pytest.raises(ValueError, match="peak_flops"):
        px.callbacks.Throughput(peak_flops=peak)


def test_a_peak_in_tflops_is_refused_with_the_unit():
    with pytest.raises(ValueError) as error:
        px.callbacks.Throughput(peak_flops=989)  # TFLOP/s meant
    assert str(error.value) == (
        "peak_flops=989 is under 1e9: it is one device's peak in FLOP/s, not "
        "TFLOP/s; pass it in FLOP/s, e.g. 989e12 for an H100's dense bf16 "
        "(989 TFLOP/s), or None"
    )
    assert px.callbacks.Throughput(peak_flops=1e9).peak_flops == 1e9


class Counted(px.DataParallelTrainer):
    """Says its step does 1 PFLOP: any peak of a GFLOP/s is far too low."""

    def flops_per_step(self, batch=None):
        return px.StepFlops(total=1e15, devices=8, size=BATCH)


def test_an_mfu_over_one_is_warned_of_once(caplog):
    throughput = px.callbacks.Throughput(log_every=1, peak_flops=1e9)
    trainer = Counted(mlp(), optax.sgd(1e-2), callbacks=[throughput], progress=False)
    x, y = batch(512)
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        for _ in range(2):
            trainer.fit(px.data.ArrayLoader((x, y), BATCH), epochs=1)
    assert min(trainer.history["mfu"]) > 1
    said = [r.getMessage() for r in caplog.records if "is over 1" in r.getMessage()]
    assert len(said) == 1, said
    assert re.fullmatch(
        r"Throughput: mfu [\d.e+]+ is over 1: [\d.e+]+ FLOP/s on 8 device\(s\), "
        r"more than peak_flops 1e\+09 FLOP/s per device allows; the peak is too "
        r"low: pass one device's peak in FLOP/s, e\.g\. "
        r"Throughput\(peak_flops=989e12\) \(said once\)",
        said[0],
    ), said[0]


def test_the_peak_table():
    bf16, f32 = np.dtype("bfloat16"), np.dtype("float32")
    assert peak_flops("NVIDIA H100 80GB HBM3", bf16) == 989e12
    assert peak_flops("NVIDIA H100 80GB HBM3", f32) == 495e12  # TF32
    assert peak_flops("NVIDIA H100 PCIe", bf16) == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", np.dtype("float16")) == 312e12
    assert peak_flops("NVIDIA H200", bf16) == 989e12
    assert peak_flops("NVIDIA B200", bf16) == 2.25e15
    assert peak_flops("TPU v4", f32) == 275e12  # one bf16 pass by default
    assert peak_flops("TPU v5 lite", bf16) == 197e12
    assert peak_flops("TPU v5p", bf16) == peak_flops("TPU v5", bf16) == 459e12
    assert peak_flops("TPU v6 lite", bf16) == 918e12
    assert peak_flops("cpu", f32) is None
    assert peak_flops("NVIDIA H100 80GB HBM3", np.dtype("float64")) is None


def test_the_summary_shows_the_step_flops():
    trainer = px.DataParallelTrainer(mlp(), optax.sgd(1e-2))
    assert trainer.summary().flops is None
    summary = trainer.summary(batch())
    assert summary.flops is not None and summary.flops.total == analytic(BATCH)
    assert "258 MFLOPs per step (32.2 MFLOPs per device)" in summary.short()
    assert "train step: 258 MFLOPs per step" in str(summary)
