"""The fit planner (issue 43): candidates compiled ahead of time, costed,
chosen. One room on both sides of the trainer: `DataParallelTrainer.plan`
hands its parts to `_entry.plan_trainer` (below it, with everything that
entry uses), and `px.plan` (`_from_shapes`, above it) builds a trainer on a
model's shapes and asks it. The default space comes from what the trainer's
strategy declares (`Strategy.mesh_settings`), never from its class."""
