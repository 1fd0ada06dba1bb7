"""The named axes of `MeshStrategy`'s mesh, in order, listed once: the
strategy builds its mesh and checks its rules against them, and the command
line checks ``--mesh``'s axes against them. It imports nothing: the command
line's parser reads it without starting JAX."""

MESH_AXES = ("data", "fsdp", "context", "tensor")
