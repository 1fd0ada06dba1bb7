"""Telemetry: the phase clock, FLOPs, alarms, GC policy, peak FLOPs, compile
cache, hang watchdog.

The modules here observe a fit (times, counts, warnings); they never change
what it computes (the hang watchdog ends a process that stopped computing).
Importers use the submodules directly; this file only documents the room.
"""
