"""Small ready-made Equinox models of one example: `Linear`, `MLP`."""

from ._linear import Linear as Linear
from ._mlp import MLP as MLP
