from ._linear import Linear as Linear
from ._mlp import MLP as MLP
