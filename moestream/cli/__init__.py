"""`moestream run | serve | bench | profile | check | perplexity | convert | archs`: the command line.

One module per command (its flags in `add_parser`, its work in `run`); the flags several commands
share and the argparse types in flags.py; what the commands share beyond flags (input checks, the
EngineConfig of the flags, loading the engine) in common.py; Ctrl-C in interrupts.py; the parser
and `main` in main.py. Errors print one line and exit 1; nothing heavy (torch, transformers) is
imported until a command needs it.
"""

from moestream.cli.common import DEMO_MODEL, engine_config
from moestream.cli.main import build_parser, main

__all__ = ["DEMO_MODEL", "build_parser", "engine_config", "main"]
