"""The command line: ``tensordiff capture | noise | diff | config | map | merge | check | replay | runs | locate | batch
| ls | show | ckpt``.

One module per command or two (argparse, then one call into the library and one renderable; ``COMMANDS`` names the
module of each): ``capture`` (capture, noise), ``diff``, ``config``, ``map``, ``merge``, ``check``, ``replay``,
``runs``, ``locate``, ``batch``, ``inspect`` (ls, show), ``ckpt``; ``_args``, the options and helpers they share.
One error handler here. Exit codes: 0 no divergence (or success), 1 divergence found, 2 bad input
or error, 3 inconclusive (``diff``: no divergence, but not everything was compared), 4 an internal error
(a bug in tensordiff: never read as a verdict). Errors print one line, never a traceback (``--debug`` or
``TENSORDIFF_DEBUG=1`` shows it for a bug).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from .. import _native
from .. import _watchdog as watchdog
from .._progress import ENV_QUIET
from .._text import first_line
from .._version import __version__
from ..errors import TensordiffError, UsageError
from . import batch, capture, check, ckpt, config, diff, inspect, locate, map, merge, replay, runs

EXAMPLE = "example: tensordiff capture -o a.h5 --steps 2 -- python train.py; tensordiff diff a.h5 b.h5 --first-divergence"
#: Exit code of an internal error (a bug in tensordiff), apart from every verdict and from bad input.
EXIT_INTERNAL = 4
QUIET = ("no progress bars (shown on a terminal only, on stderr, for work of a second or more; also "
         "TENSORDIFF_QUIET=1; a capture's program inherits it)")
#: The commands, in the order ``--help`` lists them, and the module that adds each one's parser (``add_parsers``).
COMMANDS = {"capture": capture, "noise": capture, "diff": diff, "config": config, "map": map, "merge": merge,
            "check": check, "replay": replay, "runs": runs, "locate": locate, "batch": batch, "ls": inspect,
            "show": inspect, "ckpt": ckpt}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tensordiff", description="Find where two training runs first part ways, layer by layer.",
                                epilog=EXAMPLE)
    p.add_argument("--version", action="version", version=f"tensordiff {__version__}")
    p.add_argument("--debug", action="store_true", help="print the traceback of an internal error (exit code 4)")
    p.add_argument("-q", "--quiet", action="store_true", help=QUIET)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for module in dict.fromkeys(COMMANDS.values()):
        module.add_parsers(sub)
    _add_quiet(sub)
    return p


def _add_quiet(sub: argparse._SubParsersAction, seen: set[int] | None = None) -> None:
    """``--quiet`` after every command and sub-command too (tensordiff ckpt convert a b --quiet)."""
    seen = set() if seen is None else seen
    for command_parser in sub.choices.values():
        if id(command_parser) in seen:  # an alias
            continue
        seen.add(id(command_parser))
        command_parser.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=QUIET)
        for action in command_parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                _add_quiet(action, seen)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.command is None:
        p.print_help()
        return 2
    # the command itself (not a call from Python), when it reads files rather than running a program: a read that
    # never returns is ended, exit 2
    if args.quiet:
        os.environ[ENV_QUIET] = "1"  # no progress bar; the programs tensordiff capture runs inherit it
    if argv is None and args.command not in ("capture", "noise"):
        supervised = watchdog.supervise()
        if supervised is not None:
            return supervised
        _native.keep_freed_memory()  # a process of its own that reads captures: freed blocks reused, not faulted in
    try:
        _check_outputs(args)
        return int(args.run(args))
    except TensordiffError as err:
        print(f"tensordiff: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tensordiff: interrupted", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _broken_pipe()
    except OSError as err:
        if err.filename is None:
            return _internal(args, err)
        # a path the user gave that cannot be read or written (a missing folder, a folder, no permission, a full disk)
        print(f"tensordiff: error: {err.filename}: {err.strerror or type(err).__name__}; check the path (a file, in a "
              "folder that exists and can be written)", file=sys.stderr)
        return 2
    except Exception as err:  # a bug in tensordiff, not bad input: one line, the traceback on request
        return _internal(args, err)
    finally:
        from ..store.fanout import configure

        configure()  # --jobs/--dask hold for this command only (a later call from Python reads the environment)


#: The options of every command that name a file to write.
_OUTPUTS = ("output", "json", "plot", "html", "dst")


def _check_outputs(args: argparse.Namespace) -> None:
    """Every file a command will write, before it starts: in a folder that exists, and not a folder itself."""
    for key in _OUTPUTS:
        path = getattr(args, key, None)
        if not isinstance(path, str) or not path or path == "-":
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise UsageError(f"{path}: is a folder, not a file to write; give a file name (--{key} {path}/out...)")
        if not os.path.isdir(folder):
            raise UsageError(f"{path}: the folder {folder} does not exist; create it (mkdir -p {folder}) or write "
                             "the file elsewhere")


def _broken_pipe() -> int:
    """The reader went away (tensordiff ls --records | head): stop quietly."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout at exit
    return 0


def _internal(args: argparse.Namespace, err: BaseException) -> int:
    if args.debug or os.environ.get("TENSORDIFF_DEBUG"):
        traceback.print_exception(err)
    line = first_line(err, 300, default="")
    print(f"tensordiff: internal error in {args.command}: {type(err).__name__}: {line}; please report it "
          f"(tensordiff --debug {args.command} ... shows the traceback; exit code {EXIT_INTERNAL})", file=sys.stderr)
    return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
