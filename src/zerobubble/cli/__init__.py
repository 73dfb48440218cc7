"""The ``zerobubble`` command line: parses arguments, calls the library, prints the answer.

Every user error — the project's own error types (:mod:`zerobubble.errors`): ``UsageError``,
``ScheduleError``, ``PipelineError`` and the demo's ``ConfigError`` — ends in one line on stderr
(``zerobubble: error: …``) and exit status 2; any other exception is a bug and keeps its traceback.
The demo (``train``, ``profile``) is imported inside its commands; the benchmarks (``bench``), and
torch with them, only for a command line naming ``bench``: each benchmark module declares its own
options and run (``zerobubble_bench.Benchmark``) and this module only registers them.  The library
never imports either.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import ConfigError, PipelineError, ScheduleError, UsageError
from . import plan_commands, run_commands, schedule_commands
from .base import Parser
from .run_commands import add_bench_commands

__all__ = ["UsageError", "build_parser", "main"]

# The project's own error types: a user's mistake or a failed run, reported in one line; any other
# exception is a bug and keeps its traceback.
_USER_ERRORS = (UsageError, ScheduleError, PipelineError, ConfigError)


# every command but ``bench``, in ``zerobubble --help`` order
_COMMANDS = (*schedule_commands.COMMANDS, *plan_commands.COMMANDS, *run_commands.COMMANDS)


def build_parser(benchmarks: bool = True) -> argparse.ArgumentParser:
    """The argument parser of the ``zerobubble`` command.

    ``benchmarks=False`` leaves the ``bench`` subcommands out, and with them the imports of
    ``zerobubble_bench`` and torch: ``main`` does so for a command line that does not name ``bench``.
    """
    parser = Parser(prog="zerobubble", description="Zero-bubble pipeline-parallel schedules and training.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, helptext, add_arguments, run in _COMMANDS:
        command = commands.add_parser(name, help=helptext)
        add_arguments(command)
        command.set_defaults(run=run)
    bench = commands.add_parser("bench", help="benchmarks of the runtime (results as Markdown tables)")
    if benchmarks:
        add_bench_commands(bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zerobubble`` command; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(benchmarks="bench" in argv).parse_args(argv)
        return args.run(args)
    except Exception as error:
        if not isinstance(error, _USER_ERRORS):
            raise
        print(f"zerobubble: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("zerobubble: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
