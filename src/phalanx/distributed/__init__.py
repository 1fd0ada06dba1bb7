"""Joining this process to a multi-process run: `initialize`."""

from ._initialize import initialize as initialize
