"""The MLP classifier of `mlp_classifier.py`, under `px.ShardingStrategy`.

`ShardingStrategy` writes the step in the global view: `jax.jit` over a batch
split across devices with `NamedSharding`, the compiler inserting the one
gradient all-reduce. `PmapStrategy` runs an explicit per-device program
instead. Both make the same update, and switching is one argument::

    trainer = px.DataParallelTrainer(model, optax.adam(1e-3),
                                     strategy=px.ShardingStrategy())

Run: ``python examples/mlp_sharding.py [--epochs N] [--steps N]``
"""

# Importing mlp_classifier also fakes the eight CPU devices, before JAX starts.
from mlp_classifier import main


if __name__ == "__main__":
    main(default_strategy="sharding")
