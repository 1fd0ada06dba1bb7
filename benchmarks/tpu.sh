#!/usr/bin/env bash
# phalanx on the lent TPU chip in one device call of at most 9 minutes
# (issue 53): the MLP cells against a hand-written jax.jit loop with the
# non-finite guard on and off, steps_per_call, a planted NaN gradient, and
# the GPT-2-small decoder and the tests' transformer against hand loops with
# their MFU (benchmarks/tpu.py says what each part measures). Each part has
# its own time limit, so one that hangs costs only its share, and writes its
# JSON into $OUT as it goes; the log is $OUT/log.txt.
# `python scripts/tpu_results.py DIR` then writes
# benchmarks/results/tpu-v5e.json and the table in docs/guides/speed.md.
#
# The machine (see ../shared/NOTES-tpu.md) has JAX 0.10.2 with libtpu and
# its own package index (optax, orbax-checkpoint), but not equinox,
# beartype, jaxtyping 0.3.11 and the rest: first, here, in the repository's
# root,
#
#     echo /.whl-tpu/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.11 \
#         --implementation cp --platform manylinux_2_28_x86_64 \
#         --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#         -d .whl-tpu equinox==0.13.8 beartype==0.23.1 jaxtyping==0.3.11 \
#         wadler-lindig lazy_loader tomli-w rich markdown-it-py mdurl pygments \
#         typing_extensions
#
# then run it there as `bash benchmarks/tpu.sh` with carry [".whl-tpu"] and a
# timeout of 600 s. Elsewhere (no .whl-tpu, no $OUT) it runs on what is
# installed and writes into /tmp/phalanx-tpu.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/phalanx-tpu}
mkdir -p "$OUT"
if [ -d .whl-tpu ]; then
    export PIP_CONFIG_FILE=/dev/null
    python3 -m pip install --isolated -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl || exit 1
    python3 -m pip install --isolated -q --only-binary=:all: --no-compile \
        --index-url file:///opt/pypi/simple --target /tmp/site2 \
        optax orbax-checkpoint || exit 1
    # Appended: the machine's own JAX stays first.
    export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site:/tmp/site2
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src" PYTHONUNBUFFERED=1
# The commit measured (the device machine's copy of the tree has no .git:
# pass PHALANX_COMMIT=$(git rev-parse HEAD) from a clean checkout).
echo "${PHALANX_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" > "$OUT/commit.txt"
part() { echo "== $1 ($(date +%T))"; }
# ROUNDS (3) and LM_STEPS (20) trade precision for device time.
bench() {
    timeout -k 10 "$1" python3 benchmarks/tpu.py "${@:2}" --rounds "${ROUNDS:-3}" \
        --out "$OUT"
}
{
    part "the machine"
    python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
    part "MLP cells: hand loop, default, steps_per_call=8, the guard on and off"
    bench 200 cells
    part "GPT-2 small (batch 8, 1,024 tokens) and the tests' transformer, bf16"
    bench 240 lm --lm-steps "${LM_STEPS:-20}"
    part "steps_per_call 1, 8, 32 on the tiny MLP"
    bench 50 steps
    part "a NaN gradient planted at step 3"
    bench 40 nan
    part "done"
} 2>&1 | grep -v -i "hugepages\|warnings.warn(" | tee "$OUT/log.txt"
