"""Small ready-made Equinox models of one example (`Linear`, `MLP`),
`Stacked` layers, and attention that stays exact when a strategy splits the
sequence over devices (`dot_product_attention`, `TransformerBlock`)."""

from ._attention import dot_product_attention as dot_product_attention
from ._linear import Linear as Linear
from ._mlp import MLP as MLP
from ._stacked import Stacked as Stacked
from ._transformer import TransformerBlock as TransformerBlock
