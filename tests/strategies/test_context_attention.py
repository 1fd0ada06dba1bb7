"""Issue 44, acceptance 1-3 at the trainer: `px.models.dot_product_attention`
under `MeshStrategy(context=N)` makes one device's update (all-gather and
ring, causal and not, with a padding mask), composes with accumulation,
`Stacked` + remat and tensor rules, and splits the step's memory."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import phalanx as px
from phalanx.models._attention import Implementation


VOCAB, WIDTH, HEADS, SEQ = 16, 16, 2, 32


class Block(eqx.Module):
    """Pre-norm attention (px.models.dot_product_attention), residual."""

    norm: eqx.nn.LayerNorm
    qkv: eqx.nn.Linear
    proj: eqx.nn.Linear
    causal: bool = eqx.field(static=True)
    implementation: Implementation = eqx.field(static=True)

    def __init__(self, causal: bool, implementation: Implementation, key):
        a, b = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(WIDTH)
        # No bias on q, k, v: a key bias's gradient is zero up to rounding
        # (softmax is shift invariant), which adam would blow up.
        self.qkv = eqx.nn.Linear(WIDTH, 3 * WIDTH, use_bias=False, key=a)
        self.proj = eqx.nn.Linear(WIDTH, WIDTH, key=b)
        self.causal = causal
        self.implementation = implementation

    def __call__(self, x, mask):
        h = jax.vmap(self.norm)(x)
        q, k, v = jnp.split(jax.vmap(self.qkv)(h), 3, axis=-1)
        heads = (x.shape[0], HEADS, WIDTH // HEADS)
        out = px.models.dot_product_attention(
            q.reshape(heads),
            k.reshape(heads),
            v.reshape(heads),
            causal=self.causal,
            mask=mask,
            implementation=self.implementation,
        )
        return x + jax.vmap(self.proj)(out.reshape(x.shape))


class LM(eqx.Module):
    """Tokens and their padding mask in, next-token logits out."""

    embed: eqx.nn.Embedding
    blocks: px.models.Stacked
    out: eqx.nn.Linear

    def __init__(
        self,
        causal: bool = True,
        implementation: Implementation = "ring",
        layers: int = 2,
        remat: bool = False,
    ):
        a, b, c = jax.random.split(jax.random.key(0), 3)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=a)
        self.blocks = px.models.Stacked(
            lambda key: _Masked(Block(causal, implementation, key)),
            layers,
            key=b,
            remat=remat,
        )
        self.out = eqx.nn.Linear(WIDTH, VOCAB, key=c)

    def __call__(self, x):
        h = jax.vmap(self.embed)(x["tokens"])
        h, _ = self.blocks((h, x["mask"]))
        return jax.vmap(self.out)(h)


class _Masked(eqx.Module):
    """A block that carries the mask along the stack: (x, mask) -> (x, mask)."""

    block: Block

    def __call__(self, carry):
        x, mask = carry
        return self.block(x, mask), mask


def masked_loss(logits, targets):
    """Mean cross-entropy over the real positions (targets -1: padding)."""
    real = targets >= 0
    per = optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.maximum(targets, 0)
    )
    return jnp.sum(per * real, axis=-1) / jnp.maximum(jnp.sum(real, axis=-1), 1)


def batches(n=2, examples=8, seq=SEQ):
    """Token batches, each example's last positions padded (a random length)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, VOCAB, (examples, seq + 1)).astype(np.int32)
        lengths = rng.integers(seq // 2, seq + 1, examples)
        mask = np.arange(seq)[None] < lengths[:, None]
        targets = np.where(mask, tokens[:, 1:], -1).astype(np.int32)
        out.append(({"tokens": tokens[:, :-1], "mask": mask}, targets))
    return out


DIMS = {r"x\.(tokens|mask)": 1, "y": 1}
RULES = [(r"blocks\.layers\.block\.qkv\.weight", (None, "tensor", "fsdp"))]


def trainer_for(model):
    def make(strategy):
        return px.DataParallelTrainer(
            model, optax.adam(1e-2), loss=masked_loss, strategy=strategy, progress=False
        )

    return make


@pytest.mark.parametrize("implementation", ["all_gather", "ring"])
@pytest.mark.parametrize("causal", [True, False])
def test_split_attention_makes_one_devices_update(implementation, causal):
    px.testing.assert_equivalent(
        trainer_for(LM(causal, implementation)),
        batches(),
        strategies=[
            px.MeshStrategy(data=2, context=4, sequence_dims=DIMS),
            px.MeshStrategy(
                fsdp=2, context=2, tensor=2, sequence_dims=DIMS, rules=RULES, min_size=1
            ),
        ],
        steps=3,
        rtol=1e-5,
        atol=1e-5,
    )


def test_accumulation_and_remat_over_a_split_sequence():
    px.testing.assert_equivalent(
        trainer_for(LM(remat=True)),
        batches(),
        strategies=[
            px.AccumulatingStrategy(
                px.MeshStrategy(data=2, context=4, sequence_dims=DIMS), 2
            ),
        ],
        steps=2,
        rtol=1e-5,
        atol=1e-5,
    )


def test_several_steps_per_call_bf16_and_the_flops_over_a_split_sequence():
    strategy = px.MeshStrategy(data=2, context=4, sequence_dims=DIMS)
    data = batches(n=2)
    make = trainer_for(LM(layers=1))
    one = make(strategy)
    several = px.DataParallelTrainer(
        LM(layers=1), optax.adam(1e-2), loss=masked_loss, strategy=strategy,
        progress=False, steps_per_call=2,
    )  # fmt: skip
    one.fit(data)
    several.fit(data)
    leaves = jax.tree.leaves
    for a, b in zip(leaves(several.model), leaves(one.model), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    low = px.DataParallelTrainer(
        LM(layers=1), optax.adam(1e-2), loss=masked_loss, strategy=strategy,
        progress=False, precision="bf16",
    )  # fmt: skip
    low.fit(data)
    losses = np.asarray(low.history["loss"], float)
    assert np.isfinite(losses).all()
    reference = np.asarray(one.history["loss"], float)
    np.testing.assert_allclose(losses, reference, rtol=0.02)
    # The FLOPs of the program: the causal ring skips the masked blocks.
    split = one.flops_per_step(data[0])
    whole = make(px.ShardingStrategy(devices=1)).flops_per_step(data[0])
    assert split is not None and whole is not None
    assert 0.5 * whole.total < split.total < whole.total


# --- by the splash kernel (issue 56), in Pallas' interpreter -------------------------


@pytest.fixture
def kernel_blocks(monkeypatch):
    """Attention by the splash kernel in Pallas' interpreter, as a TPU runs
    it; the shapes of the blocks it computed. The reference (one device in
    a global view over the process' 8) stays XLA's attention."""
    from phalanx.models import _splash, _tpu_attention

    monkeypatch.setattr(_tpu_attention, "INTERPRET", True)
    calls = []
    attend = _splash.attend

    def recorded(query, key, *args):
        calls.append((query.shape, key.shape, args[-2]))
        return attend(query, key, *args)

    monkeypatch.setattr(_splash, "attend", recorded)
    return calls


def test_ring_blocks_by_the_kernel_make_one_devices_update(kernel_blocks):
    # Issue 56, acceptance 1: a causal ring over context=4 whose blocks are
    # the kernel's (parts of 1,024 / 8 = 128 positions), padded examples.
    px.testing.assert_equivalent(
        trainer_for(LM(layers=1)),
        batches(n=2, examples=2, seq=1024),
        strategies=[px.MeshStrategy(data=2, context=4, sequence_dims=DIMS)],
        steps=2,
        rtol=1e-5,
        atol=1e-5,
    )
    # Each device: its two halves against themselves (the causal diagonal),
    # then full blocks; all 128 long, 2 heads of 8.
    block = (HEADS, 128, WIDTH // HEADS)
    assert {(q, k) for q, k, _ in kernel_blocks} == {(block, block)}
    assert {causal for *_, causal in kernel_blocks} == {True, False}


def test_kernel_blocks_compose_with_accumulation_remat_and_steps_per_call(
    kernel_blocks,
):
    # The all-gather's blocks: which chunk is the diagonal is known only at
    # run time (chunks of 256 / 2 = 128).
    def make(strategy):
        return px.DataParallelTrainer(
            LM(implementation="all_gather", remat=True),
            optax.adam(1e-2),
            loss=masked_loss,
            strategy=strategy,
            progress=False,
            steps_per_call=2,
        )

    px.testing.assert_equivalent(
        make,
        batches(n=2, examples=4, seq=256),
        strategies=[
            px.AccumulatingStrategy(
                px.MeshStrategy(4, data=2, context=2, sequence_dims=DIMS), 2
            )
        ],
        steps=2,
        rtol=1e-5,
        atol=1e-5,
    )
    assert kernel_blocks  # the kernel computed the split attention


def test_kernel_blocks_in_bf16_train_as_float32_does(kernel_blocks):
    strategy = px.MeshStrategy(4, data=2, context=2, sequence_dims=DIMS)
    data = batches(n=2, examples=2, seq=256)
    losses = {}
    for precision in ("fp32", "bf16"):
        trainer = px.DataParallelTrainer(
            LM(causal=False, layers=1), optax.adam(1e-2), loss=masked_loss,
            strategy=strategy, progress=False, precision=precision,
        )  # fmt: skip
        trainer.fit(data)
        losses[precision] = np.asarray(trainer.history["loss"], float)
    assert kernel_blocks
    np.testing.assert_allclose(losses["bf16"], losses["fp32"], rtol=0.02)


def test_non_causal_all_gather_by_the_kernel_makes_one_devices_update(
    kernel_blocks,
):
    # Issue 56: not causal, the all-gather is one kernel call a device, its
    # chunk of queries (256 / 2 = 128) against every key (256), the padding
    # mask the gathered one.
    px.testing.assert_equivalent(
        trainer_for(LM(causal=False, implementation="all_gather", layers=1)),
        batches(n=2, examples=2, seq=256),
        strategies=[px.MeshStrategy(4, data=2, context=2, sequence_dims=DIMS)],
        steps=2,
        rtol=1e-5,
        atol=1e-5,
    )
    queries, keys = (HEADS, 128, WIDTH // HEADS), (HEADS, 256, WIDTH // HEADS)
    assert set(kernel_blocks) == {(queries, keys, False)}
