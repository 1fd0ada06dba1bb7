"""The TPU programs of `tests/plan/tpu_v5e_hlo.json`: small programs
compiled for a TPU v5e ahead of time, on a host without one, with each
one's FLOPs counted by hand (what `tests/plan/test_step_work.py` checks the
planner's HLO reading against).

JAX compiles for a TPU it does not have through libtpu's topology
description (`jax.experimental.topologies`); libtpu is not a dependency of
phalanx. In a virtual environment of its own:

    python -m venv /tmp/tpu && . /tmp/tpu/bin/activate
    pip install jax==0.10.2 jaxlib==0.10.2 "libtpu==0.0.42.*"
    python scripts/tpu_hlo.py

rewrites the compiled entries and keeps the hand-written ones (those not
in `PROGRAMS`, e.g. "prefetched"). Metadata, backend configs and frontend
attributes are stripped: the planner reads none of them, and they carry
the source paths of the host that compiled them. The same route compiles
a whole train step for the chip, to read its HLO, its memory analysis and
the planner's prediction without spending device time.
"""

import json
import pathlib
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import topologies


OUT = pathlib.Path(__file__).resolve().parent.parent / "tests/plan/tpu_v5e_hlo.json"
NHWC = ("NHWC", "HWIO", "NHWC")


def _conv(x: Any, w: Any, stride: int) -> Any:
    return jax.lax.conv_general_dilated(
        x, w, (stride, stride), "SAME", dimension_numbers=NHWC
    )


def _scan(x: Any, w: Any) -> Any:
    def body(total: Any, xi: Any) -> tuple[Any, None]:
        return total + jnp.tanh(xi @ w).sum(), None

    return jax.lax.scan(body, 0.0, x)[0]


def _both_gradients(x: Any, w: Any) -> Any:
    loss = lambda x, w: jnp.sin(_conv(x, w, 2)).sum()  # noqa: E731
    return jax.grad(loss, argnums=(0, 1))(x, w)


F32, BF16 = jnp.float32, jnp.bfloat16
# name: (function, argument shapes and dtypes, FLOPs counted by hand).
PROGRAMS: dict[
    str, tuple[Callable[..., Any], list[tuple[tuple[int, ...], Any]], int]
] = {
    # Attention's scores: a batched matrix multiply, its batch axes spatial.
    "bhqd_bhkd": (
        lambda q, k: jnp.einsum("bhqd,bhkd->bhqk", q, k),
        [((4, 8, 512, 64), F32)] * 2,
        2 * 4 * 8 * 512 * 512 * 64,
    ),
    "batched_bf16": (
        lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
        [((16, 256, 128), BF16), ((16, 128, 384), BF16)],
        2 * 16 * 256 * 128 * 384,
    ),
    "matmul": (
        lambda a, b: a @ b,
        [((256, 512), F32), ((512, 1024), F32)],
        2 * 256 * 512 * 1024,
    ),
    # The product and its gradient's two (the input's one is simplified away
    # by XLA: the weights' and the product's remain).
    "grad_wrt_w": (
        lambda x, w: jax.grad(lambda w: jnp.sin(x @ w).sum())(w),
        [((4096, 1024), F32), ((1024, 4096), F32)],
        2 * 2 * 4096 * 1024 * 4096,
    ),
    # 3x3 SAME: each axis's taps 3 a position but 2 at each edge (94 of 96).
    "conv": (
        lambda x, w: _conv(x, w, 1),
        [((8, 32, 32, 16), F32), ((3, 3, 16, 32), F32)],
        2 * 8 * 32 * 16 * 94 * 94,
    ),
    # Stride 2 (16x16 out, its last row and column 2 taps: 47 of 48 an
    # axis), and its two gradients: the same multiply-adds each.
    "conv_grad": (
        _both_gradients,
        [((8, 32, 32, 16), F32), ((3, 3, 16, 32), F32)],
        3 * 2 * 8 * 32 * 16 * 47 * 47,
    ),
    # A scan of 4: XLA:TPU prints no trip count; its condition says i < 4.
    "scan": (
        _scan,
        [((4, 256, 512), F32), ((512, 512), F32)],
        4 * 2 * 256 * 512 * 512,
    ),
}


def strip(hlo: str) -> str:
    """`hlo` without what the planner does not read."""
    kept = []
    for line in hlo.splitlines():
        if line.startswith(
            ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
        ):
            continue
        if re.match(r"^\d+ [{\"]", line):
            continue
        line = re.sub(r", metadata=\{[^}]*\}", "", line)
        line = re.sub(r", backend_config=\{.*\}$", "", line)
        line = re.sub(r", frontend_attributes=\{[^}]*\}\}?", "", line)
        kept.append(line)
    return "\n".join(kept).strip() + "\n"


def main() -> None:
    topology = topologies.get_topology_desc(
        "v5e:1x1", "tpu", chips_per_host_bounds=[1, 1, 1]
    )
    mesh = jax.sharding.Mesh(topology.devices, ("x",))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    found = json.loads(OUT.read_text()) if OUT.exists() else {}
    for name, (function, shapes, flops) in PROGRAMS.items():
        arguments = [jax.ShapeDtypeStruct(s, d, sharding=whole) for s, d in shapes]
        compiled = jax.jit(function).lower(*arguments).compile()
        found[name] = {"flops": flops, "hlo": strip(compiled.as_text())}
        print(name, len(found[name]["hlo"]), "characters")
    OUT.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
