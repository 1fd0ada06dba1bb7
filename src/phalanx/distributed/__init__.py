from ._initialize import initialize as initialize
