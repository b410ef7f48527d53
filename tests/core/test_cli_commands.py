"""The command line's one list of commands: ``COMMANDS``, the parser built from it and ``cli/__init__.py``'s docstring
name the same commands, in the order ``tensordiff --help`` lists them."""

from __future__ import annotations

import argparse
import re

from tensordiff import cli


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _docstring_commands() -> list[str]:
    match = re.search(r"``tensordiff ([^`]*)``", cli.__doc__ or "")
    assert match, "cli/__init__.py's docstring lists no ``tensordiff A | B | ...``"
    return [name.strip() for name in match.group(1).split("|")]


def test_the_docstring_the_parser_and_commands_name_the_same_commands_in_one_order():
    assert list(_subcommands()) == list(cli.COMMANDS) == _docstring_commands()


def test_each_command_runs_in_the_module_commands_names():
    for name, sub in _subcommands().items():
        run = sub.get_default("run")
        assert callable(run), name
        assert run.__module__ == cli.COMMANDS[name].__name__, name
