"""Telemetry: the phase clock, FLOPs, alarms, GC policy, peak FLOPs, compile cache.

The modules here observe a fit (times, counts, warnings); they never change
what it computes. Importers use the submodules directly; this file only
documents the room.
"""
