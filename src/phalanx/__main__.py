"""``python -m phalanx``: the ``phalanx`` command line run as a module.

It only calls `phalanx.cli.main` and exits with its code. The command line
imports its parser alone until the command is valid, so nothing here may
import JAX or the trainer: ``python -m phalanx --help`` must stay fast."""

import sys

from .cli._main import main


sys.exit(main())
