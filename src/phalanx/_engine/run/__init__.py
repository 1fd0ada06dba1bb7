"""The engine's room that runs the programs: the fit's loop, its calls and
events, evaluation, prediction, the learning-rate finder."""
