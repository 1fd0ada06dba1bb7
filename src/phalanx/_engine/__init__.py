"""The engine: what a batch goes through, in rooms along its path, each
importing only the rooms after it (`lint-imports` holds them to it):

- `run`: the fit's loop, its compiled calls and events, evaluation,
  prediction and the learning-rate finder: what runs the programs;
- `feed`: reading, checking and placing batches (the pipeline, the
  prefetching feed, the first program built from the first batch);
- `program`: the batch spec, `Program` and `Programs` (which build and keep
  them), compiled ahead of time with their layouts proven, the layout lint,
  hints and the summary;
- `step`: what is traced: the forward pass, the gradient, its reduction,
  the non-finite guard, parameter groups and the state's layout.
"""
