"""The ``zerobubble`` command line: parses arguments, calls the library, prints the answer.

Every user error — the project's own error types: ``UsageError``, ``ScheduleError``,
``PipelineError`` and the demo's ``ConfigError`` — ends in one line on stderr
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

from ..schedule import ScheduleError
from . import plan_commands, run_commands, schedule_commands
from .base import Parser, UsageError
from .run_commands import add_bench_commands

__all__ = ["UsageError", "build_parser", "main"]


def _is_user_error(error: Exception) -> bool:
    """The project's own error types: a user's mistake or a failed run, reported in one line.

    The runtime's ``PipelineError`` and the demo's ``ConfigError`` are looked up only if their
    module is loaded (importing them would load torch); any other exception is a bug: traceback.
    """
    if isinstance(error, (UsageError, ScheduleError)):
        return True
    kinds = [
        getattr(sys.modules.get(module), name, None)
        for module, name in (("zerobubble.runtime", "PipelineError"), ("zerobubble_demo", "ConfigError"))
    ]
    return any(isinstance(error, kind) for kind in kinds if isinstance(kind, type))


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
        if not _is_user_error(error):
            raise
        print(f"zerobubble: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("zerobubble: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
