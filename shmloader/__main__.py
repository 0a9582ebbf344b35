"""``python -m shmloader``: the ``config``, ``doctor`` and ``bench`` commands.

Owns: the command line (argument parsing, output, exit codes). Runs in its own process. Promises:
``config`` prints each option's effective value, its source (argument, environment, default) and
its variable, or JSON with ``--json``; ``doctor`` prints findings with remedies and exits 1 when
one is a problem (see :mod:`shmloader.cli.doctor`); ``bench`` hands the rest of the command line to
``shmloader.cli.bench.main`` (``bench --train``: the end-to-end training benchmark). A bad
``SHMLOADER_*`` value exits 2 with the error's message. Ctrl-C (KeyboardInterrupt) during any
command prints ``python -m shmloader: interrupted`` on stderr and exits 130, with no traceback; the
commands close what they started on the way out (``bench``'s loaders and copy-limit processes), a
second Ctrl-C being held back until that is done (:mod:`shmloader.cli.interrupt`). A reader of
stdout that went away (``python -m shmloader config | head -1``) ends the command with status 141,
as a shell reports a command that SIGPIPE ended, and no traceback. torch is imported only by
``doctor`` (to report it) and by whatever ``bench`` needs.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from shmloader.cli import doctor
from shmloader.cli.interrupt import ctrl_c_handled
from shmloader.config import check_environment, describe
from shmloader.errors import ConfigError

__all__ = ["main"]

_PROG = "python -m shmloader"
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command that Ctrl-C ended
PIPE_CLOSED = 141  # 128 + SIGPIPE, as a shell reports a command whose reader went away (`| head`)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_PROG, description="shmloader: configuration, checks, benchmarks.")
    commands = parser.add_subparsers(dest="command", metavar="{config,doctor,bench}")
    config = commands.add_parser("config", help="print each option's effective value, source and variable")
    config.add_argument("--json", action="store_true", help="print JSON: option -> value, source, variable")
    doctor.add_arguments(commands.add_parser(
        "doctor", help="check the machine against what a loader needs (exit 1 on a problem)"))
    commands.add_parser("bench", help="shmloader vs torch's DataLoader, medians of repeated rounds "
                        "(options: bench --help; training benchmark: bench --train --help)", add_help=False)
    return parser


def _jsonable(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def _print_config(as_json: bool) -> int:
    rows = describe(check_environment())
    if as_json:
        body = {r.name: {"value": _jsonable(r.value), "source": r.source, "variable": r.variable, "note": r.note}
                for r in rows}
        print(json.dumps(body, indent=2))
        return 0
    table = [("option", "value", "source", "variable")] + [(r.name, repr(r.value), r.source, r.variable) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(3)]
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[3])
    for row in rows:
        if row.note:
            print(f"note: {row.note}")
    return 0


def _bench(argv: Sequence[str]) -> int:
    try:
        bench = importlib.import_module("shmloader.cli.bench")
    except ModuleNotFoundError as exc:
        if exc.name != "shmloader.cli.bench":
            raise
        print(f"{_PROG} bench: shmloader.cli.bench is not available in this installation", file=sys.stderr)
        return 2
    return int(bench.main(list(argv)) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code (0 ok, 1 doctor found a problem, 2 usage or config
    error, 130 interrupted: Ctrl-C is one line on stderr, not a traceback; 141 stdout's reader went
    away)."""
    with ctrl_c_handled():
        try:
            code = _command(list(sys.argv[1:] if argv is None else argv))
            sys.stdout.flush()  # now, where a reader that went away is caught, not at interpreter exit
            return code
        except BrokenPipeError:
            _drop_stdout()
            return PIPE_CLOSED
        except KeyboardInterrupt:
            pass
        except Exception as exc:
            if not _set_off_by_ctrl_c(exc):
                raise
        # Out of the except block: the traceback, which held the frames of whatever was running, is
        # gone; what the commands did not close themselves is finalized now, not at interpreter exit.
        gc.collect()
    print(f"{_PROG}: interrupted", file=sys.stderr)
    return INTERRUPTED


def _drop_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for the reader that went away is dropped,
    so the interpreter's own flush at exit raises (and prints) nothing more."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (a caller's own stream): nothing is flushed at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _set_off_by_ctrl_c(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while a KeyboardInterrupt unwound the command (it is in its
    context chain): torch's SIGCHLD handler, say, raising in the cleanup because the Ctrl-C sent to
    the process group also ended one of its workers. The interrupt is what the user did."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__context__
    return False


def _command(args_in: list[str]) -> int:
    if args_in[:1] == ["bench"]:
        return _bench(args_in[1:])
    parser = _parser()
    args = parser.parse_args(args_in)
    try:
        if args.command == "config":
            return _print_config(args.json)
        if args.command == "doctor":
            return doctor.run(args)
    except ConfigError as exc:
        print(f"{_PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
