"""The engine's room of compiled programs: a batch's spec, `Program` and
`Programs`, ahead-of-time compiles with their layouts proven, the layout
lint, hints and the summary."""
