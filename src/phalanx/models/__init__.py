"""Small ready-made Equinox models of one example (`Linear`, `MLP`) and
`Stacked` layers."""

from ._linear import Linear as Linear
from ._mlp import MLP as MLP
from ._stacked import Stacked as Stacked
