"""Telemetry: the phase clock, FLOPs, alarms, the GC policy and the peak FLOPs table.

The modules here observe a fit (times, counts, warnings); they never change
what it computes. Importers use the submodules directly; this file only
documents the room.
"""
