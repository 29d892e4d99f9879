"""The commands of ``openlora-otel``, one module each.

Each module's ``register(commands)`` adds its parser to the subparsers of the command line and sets
``func`` on it: the function that takes the parsed arguments and returns the exit status.
:mod:`openlora_otel.cli` only dispatches. The order here is the order ``--help`` lists them in.
"""

from openlora_otel.commands import demo, diagnose, doctor, env, load, metrics, report, rules, serve, stack

COMMANDS = (demo, serve, doctor, env, metrics, rules, stack, report, diagnose, load)

__all__ = ["COMMANDS"]
