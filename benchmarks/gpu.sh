#!/usr/bin/env bash
# The accelerator checks in one run of at most 9 minutes: issue 17's
# short-step benchmarks (a tiny MLP and the 784-256-128-10 MLP, the
# non-finite guard on and off and against optax.apply_if_finite,
# steps_per_call, a Timeline on and off), MFU (benchmarks/mfu.py), the
# attention's cuDNN path (benchmarks/attention.py, issue 44) and the fit
# planner's predictions against measured steps (benchmarks/plan.py, issue 43).
# Every part has its own time limit, so one that hangs costs only its share;
# each writes its JSON and the log into $OUT as it ends.
#
# For a session lent a device machine (the `device` tool). The machine has
# JAX, Equinox, Optax, Orbax, jaxtyping and rich, not beartype, tomli-w or lazy_loader:
# first, here, in the repository's root,
#
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: \
#         --python-version 3.12 -d .whl beartype tomli-w lazy_loader
#
# then run it there as `bash benchmarks/gpu.sh` with carry [".whl"] and a
# timeout of 600 s. Elsewhere (no .whl, no $OUT) it runs on what is
# installed and writes into /tmp/phalanx-gpu.
set -uo pipefail
OUT=${OUT:-/tmp/phalanx-gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
part() { echo "== $1 ($(date +%T))"; }
{
    part "the machine"
    nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
    python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
    part "phalanx trains (three steps)"
    timeout -k 15 60 python3 - <<'PY' || exit 1
import jax, numpy as np, optax
import phalanx as px
model = px.models.MLP(16, 4, hidden=(16,), key=jax.random.key(0))
trainer = px.DataParallelTrainer(model, optax.adam(1e-3), progress=False)
x = np.zeros((64, 16), np.float32)
y = np.zeros(64, np.int32)
trainer.fit([(x, y)] * 3)
print(trainer.strategy, "step", int(trainer.state.step), jax.devices()[0].device_kind)
PY
    part "tiny MLP 16-16-4, batch 64"
    timeout -k 15 130 python3 benchmarks/run.py --model tiny --devices 1 \
        --repeats 3 --run-seconds 0.5 \
        --batch-sizes 64 --data device,host \
        --cases sharding,steps-per-call,nan-guard,guard-vs-optax,timeline \
        --out "$OUT/tiny.json"
    part "MLP 784-256-128-10, batches 256 and 2048"
    timeout -k 15 90 python3 benchmarks/run.py --devices 1 --batch-sizes 256,2048 \
        --repeats 3 --run-seconds 0.5 \
        --data device --cases sharding,steps-per-call,nan-guard \
        --out "$OUT/mlp.json"
    part "MFU, MLP 1024-8192x4-10, batch 8192, fp32 and bf16"
    timeout -k 15 80 python3 benchmarks/mfu.py --out "$OUT/mfu.json"
    part "attention: cuDNN's kernel against XLA's, causal, 8 heads of 64"
    timeout -k 15 50 python3 benchmarks/attention.py --seq 1024,4096,16384 \
        --out "$OUT/attention.json"
    part "the fit planner: a Stacked transformer of ~20 M parameters"
    timeout -k 15 110 python3 benchmarks/plan.py --batch 32 --seq 512 \
        --out "$OUT/plan.json"
    part "done"
} 2>&1 | tee "$OUT/log.txt"
