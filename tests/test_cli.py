"""The command line's help: every flag of `tandem serve` says its default."""
import argparse

import pytest

from tandem.cli import build_parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


@pytest.mark.parametrize("role", ["target", "draft", "orchestrator"])
def test_every_serve_flag_states_its_default(role):
    parser = _subparsers(_subparsers(build_parser())["serve"])[role]
    silent = [action.option_strings[0] for action in parser._actions
              if action.option_strings and action.help not in (None, argparse.SUPPRESS)
              and action.default not in (None, argparse.SUPPRESS)
              and "default" not in action.help]
    assert silent == [], f"tandem serve {role}: flags whose --help hides their default: {silent}"
    help_text = parser.format_help()  # and the help renders (a stray % would raise here)
    assert "(default: " in help_text
