"""The fit planner (issue 43): candidates compiled ahead of time, costed, chosen."""
