#!/usr/bin/env bash
# phalanx on the lent TPU chip (issues 53 and 56), part by part: the MLP
# cells against a hand-written jax.jit loop with the non-finite guard on and
# off, steps_per_call, a planted NaN gradient, and the GPT-2-small decoder
# and the tests' transformer against hand loops with their MFU
# (benchmarks/tpu.py says what each part measures); attention alone, the
# splash kernel against XLA's at 4k-16k tokens (benchmarks/attention.py);
# and a ~19 M decoder trained at 16k, 32k and 64k tokens on the one chip,
# and against XLA's attention at 4k (examples/long_sequence.py); the
# planner's predicted peak and step time against the device's, for the MLP
# and the tests' transformer (plan) and GPT-2 small (plan125), each
# configuration in a process of its own (benchmarks/plan_accuracy.py). Each part
# has its own time limit, so one that hangs costs only its share, and writes
# its JSON into $OUT as it goes; the log is $OUT/log.txt.
#
#     bash benchmarks/tpu.sh [PART ...]   # cells lm steps nan attention long plan plan125
#
# runs the parts named (all without one). Their limits add up to more than
# the 10 minutes a device call may take: run "cells lm steps nan" in one
# call, "attention long" in another, and "plan" and "plan125" one a call.
# `python scripts/tpu_results.py DIR [DIR ...]` then writes
# benchmarks/results/tpu-v5e.json (the parts found there; the others kept)
# and the table in docs/guides/speed.md.
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
# then run it there as `bash benchmarks/tpu.sh [PART ...]` with carry
# [".whl-tpu"] and a timeout of 600 s. Elsewhere (no .whl-tpu, no $OUT) it
# runs on what is installed and writes into /tmp/phalanx-tpu; off a TPU the
# attention and long parts run at a tiny size (a CPU takes minutes a step
# of the decoder at 16k tokens).
set -uo pipefail
cd "$(dirname "$0")/.."
# Whether part $1 runs: named on the command line, or none named.
for name in "$@"; do
    case $name in
        cells | lm | steps | nan | attention | long | plan | plan125) ;;
        *) echo "unknown part $name: cells lm steps nan attention long plan plan125" >&2; exit 2 ;;
    esac
done
PARTS=" $* "
wanted() { [ "$PARTS" = "  " ] || [[ "$PARTS" == *" $1 "* ]]; }
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
# The attention and long parts' sizes: issue 56's on a TPU, tiny elsewhere.
if [ "$(python3 -c 'import jax; print(jax.default_backend())')" = tpu ]; then
    ATTENTION=(--seq 4096,8192,16384 --batch 4)
    LONG=(--seq 16384,32768,65536)
    COMPARE=(--compare-xla 4096)
    TINY=()
else
    ATTENTION=(--seq 256,512 --batch 1)
    LONG=(--seq 256,512 --layers 1 --width 64)
    COMPARE=(--compare-xla 256 --layers 1 --width 64)
    TINY=(--tiny)
fi
# ROUNDS (3) and LM_STEPS (20) trade precision for device time.
# PLAN_ARGS (--models mlp,transformer) are the plan part's arguments to
# benchmarks/plan_accuracy.py: each configuration takes a process and 35 s
# (the MLP) to 100 s (the transformer) on the v5e, so a call holds about
# five of the transformer's; GPT-2 small's whole plan goes in a call of its
# own, e.g. PLAN_ARGS="--models mlp --whole-of decoder --measured
# scratch/plan_accuracy_decoder.json" with plan125's JSON carried there.
bench() {
    timeout -k 10 "$1" python3 benchmarks/tpu.py "${@:2}" --rounds "${ROUNDS:-3}" \
        --out "$OUT"
}
{
    part "the machine"
    python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
    if wanted cells; then
        part "MLP cells: hand loop, default, steps_per_call=8, the guard on and off"
        bench 200 cells
    fi
    if wanted lm; then
        part "GPT-2 small (batch 8, 1,024 tokens) and the tests' transformer, bf16"
        bench 240 lm --lm-steps "${LM_STEPS:-20}"
    fi
    if wanted steps; then
        part "steps_per_call 1, 8, 32 on the tiny MLP"
        bench 50 steps
    fi
    if wanted nan; then
        part "a NaN gradient planted at step 3"
        bench 40 nan
    fi
    if wanted attention; then
        part "attention: the splash kernel against XLA's, causal, 4 x 8 heads of 64, bf16"
        timeout -k 10 90 python3 benchmarks/attention.py "${ATTENTION[@]}" \
            --heads 8 --dim 64 --dtypes bfloat16 --out "$OUT/attention.json"
    fi
    if wanted long; then
        part "a ~19 M decoder at 16k, 32k and 64k tokens, batch 1, remat, bf16"
        timeout -k 10 110 python3 examples/long_sequence.py "${LONG[@]}" --steps 5 \
            --out "$OUT/long.json"
        # In float32 at 'highest' matmul precision, where both are exact.
        part "the same decoder at 4,096 tokens, 20 steps, fp32: the kernel's loss and XLA's"
        timeout -k 10 90 python3 examples/long_sequence.py "${COMPARE[@]}" --steps 20 \
            --precision fp32 --highest --out "$OUT/long_xla.json"
    fi
    if wanted plan; then
        part "the plan's peak and step against the device's: the MLP, the tests' transformer"
        # shellcheck disable=SC2086  # PLAN_ARGS: several arguments
        timeout -k 10 540 python3 benchmarks/plan_accuracy.py \
            ${PLAN_ARGS:---models mlp,transformer} "${TINY[@]}" --out "$OUT"
    fi
    if wanted plan125; then
        part "the plan's peak and step against the device's: GPT-2 small, and its whole plan"
        timeout -k 10 560 python3 benchmarks/plan_accuracy.py --models decoder \
            --whole-of none "${TINY[@]}" --out "$OUT"
    fi
    part "done"
} 2>&1 | grep -v -i "hugepages\|warnings.warn(" | tee "$OUT/log.txt"
