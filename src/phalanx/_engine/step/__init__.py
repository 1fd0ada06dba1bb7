"""The engine's room of what is traced: the forward pass, the gradient and
its reduction, the non-finite guard, parameter groups, the state's layout."""
