"""The check the built-in models make of one example's features, with the fix
in its message. It runs at trace time on static shapes, so it costs nothing
per step and never computes on the devices."""

from jaxtyping import Array


def check_features(x: Array, in_size: int, model: str) -> None:
    """Raise a clear error when one example does not have `in_size` features.

    Runs at trace time (shapes are static), so it costs nothing per step.
    """
    if x.shape != (in_size,):
        features = x.shape[-1] if x.ndim else 1
        raise ValueError(
            f"{model} expects one example of shape ({in_size},), got x.shape="
            f"{tuple(x.shape)}; give each example {in_size} features (flatten "
            f"images first), or build the model with in_size={features}"
        )
