"""The command line's help: every flag that has a default says what it is."""
import argparse

import pytest

from tandem.cli import build_parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Every command a user runs, by its words: "tandem", "tandem serve draft", ..."""
    commands = {"tandem": build_parser()}
    for name, sub in _subparsers(commands["tandem"]).items():
        if name in ("serve", "ray"):
            commands.update({f"tandem {name} {role}": p for role, p in _subparsers(sub).items()})
        else:
            commands[f"tandem {name}"] = sub
    return commands


COMMANDS = _commands()


def test_the_commands_are_all_here():
    assert {"tandem serve target", "tandem serve draft", "tandem serve orchestrator", "tandem generate",
            "tandem chat", "tandem models", "tandem batch", "tandem ray up", "tandem ray status",
            "tandem ray down"} <= set(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_states_its_default(command):
    parser = COMMANDS[command]
    silent = [action.option_strings[0] for action in parser._actions
              if action.option_strings and not isinstance(action, argparse._HelpAction)
              and action.default not in (None, False, argparse.SUPPRESS)
              and (not action.help or "default" not in action.help)]
    assert silent == [], f"{command}: flags whose --help hides their default: {silent}"
    assert "usage:" in parser.format_help()  # it renders: a stray % in a help text would raise here


def test_sampling_flags_become_the_request_parameters():
    from tandem.cli_flags import sampling_kwargs as _sampling_kwargs

    args = build_parser().parse_args(["generate", "x", "--logit-bias", "5=-100", "--logit-bias", "7=2.5",
                                      "--min-tokens", "3", "--stop-token-id", "9", "--ignore-eos", "--logprobs", "2",
                                      "--frequency-penalty", "0.5", "--repetition-penalty", "1.1", "--min-p", "0.05"])
    kwargs = _sampling_kwargs(args)
    assert kwargs["logit_bias"] == {5: -100.0, 7: 2.5} and kwargs["min_tokens"] == 3
    assert kwargs["stop_token_ids"] == [9] and kwargs["ignore_eos"] and kwargs["top_logprobs"] == 2
    from tandem.client import params_message

    message = params_message(**kwargs)  # what the client sends
    assert dict(message.logit_bias) == {5: -100.0, 7: 2.5} and message.logprobs
    assert message.frequency_penalty == 0.5 and not message.HasField("presence_penalty")
    assert abs(message.repetition_penalty - 1.1) < 1e-6 and abs(message.min_p - 0.05) < 1e-6
    for bad in (["--logit-bias", "5"], ["--logit-bias", "5=101"], ["--min-tokens", "-1"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["generate", "x", *bad])


def test_on_off_flags_become_the_configs_switches():
    """--pipeline and --prefill-overlap on|off|auto reach the configs as True,
    False and None (auto: the server decides)."""
    from tandem.cli_flags import sampling_kwargs, switch

    assert [switch(value) for value in ("on", "off", "auto", None)] == [True, False, None, None]
    for value, expected in (("on", True), ("off", False)):
        args = build_parser().parse_args(["serve", "orchestrator", "--pipeline", value, "--prefill-overlap", value])
        assert (switch(args.pipeline), switch(args.prefill_overlap)) == (expected, expected)
        assert sampling_kwargs(build_parser().parse_args(["generate", "x", "--pipeline", value]))["pipeline"] is expected


def test_structured_output_flags_become_one_format(tmp_path):
    from tandem.cli_flags import sampling_kwargs as _sampling_kwargs
    from tandem.client import params_message

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    for flags, field, value in [
        (["--json-schema", f"@{schema}"], "json_schema", '{"type": "object"}'),
        (["--json-schema", '{"type": "integer"}'], "json_schema", '{"type": "integer"}'),
        (["--json-object"], "json_object", True),
        (["--regex", "[0-9]+"], "regex", "[0-9]+"),
        (["--choice", "yes", "--choice", "no"], "choice", ["yes", "no"]),
        (["--grammar", 'start: "a"'], "lark", 'start: "a"'),
    ]:
        message = params_message(**_sampling_kwargs(build_parser().parse_args(["generate", "x", *flags])))
        fmt = message.structured_output
        assert fmt.WhichOneof("format") == field
        assert (list(fmt.choice.choices) if field == "choice" else getattr(fmt, field)) == value
    assert not params_message(**_sampling_kwargs(build_parser().parse_args(["generate", "x"]))).HasField(
        "structured_output")
    with pytest.raises(SystemExit):  # one format at a time
        build_parser().parse_args(["generate", "x", "--regex", "a", "--choice", "b"])
    after = params_message(**_sampling_kwargs(build_parser().parse_args(
        ["generate", "x", "--json-object", "--format-after", "</think>"]))).structured_output
    assert after.json_object and after.after == "</think>"
    with pytest.raises(SystemExit, match="needs a format"):
        _sampling_kwargs(build_parser().parse_args(["generate", "x", "--format-after", "</think>"]))


def test_reasoning_flags_ask_the_server_to_count_the_reasoning():
    from tandem.cli_flags import sampling_kwargs as _sampling_kwargs
    from tandem.client import params_message
    from tandem.v1 import tandem_pb2

    def params(*flags):
        return params_message(**_sampling_kwargs(build_parser().parse_args(["generate", "x", *flags])))

    assert not params().HasField("reasoning")
    assert params("--reasoning-end", "</think>").reasoning == tandem_pb2.Reasoning(end="</think>")
    both = params("--reasoning-end", "</think>", "--reasoning-start", "<think>").reasoning
    assert (both.end, both.start) == ("</think>", "<think>")
    with pytest.raises(SystemExit, match="needs --reasoning-end"):
        params("--reasoning-start", "<think>")


def test_keep_special_tokens_asks_for_them_in_the_text():
    from tandem.cli_flags import sampling_kwargs as _sampling_kwargs
    from tandem.client import params_message

    def params(*flags):
        return params_message(**_sampling_kwargs(build_parser().parse_args(["generate", "x", *flags])))

    assert not params().HasField("skip_special_tokens")
    kept = params("--keep-special-tokens")
    assert kept.HasField("skip_special_tokens") and not kept.skip_special_tokens
