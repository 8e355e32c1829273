"""`snoozectl --help` and every command's help: flags read as flags, defaults and examples are shown,
the version is printed (issue 21 item 7)."""

from __future__ import annotations

import re
from importlib.metadata import version
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from controlplane.cli import app

RUNNER = CliRunner()


def _commands() -> list[list[str]]:
    """Every command path, sub-commands included (convert torch, fleet up, ...)."""
    root = typer.main.get_command(app)
    paths = []

    def walk(command: Any, path: list[str]) -> None:
        if hasattr(command, "commands"):  # a group (typer vendors its own click)
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
        else:
            paths.append(path)

    walk(root, [])
    return paths


def _help(*words: str) -> str:
    result = RUNNER.invoke(app, [*words, "--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("words", [[], *_commands()], ids=lambda w: " ".join(w) or "snoozectl")
def test_flags_show_no_type_and_help_text_is_not_eaten_as_markup(words: list[str]) -> None:
    text = _help(*words)
    assert "<bool>" not in text  # a flag takes no value
    options = [line for line in text.splitlines() if line.lstrip().startswith("-")]
    assert not [o for o in options if "<list[" in o]  # a repeatable option shows one value (NAME=VALUE, MODEL_ID)
    assert "--help" in text


def test_serve_help_shows_its_defaults_and_examples() -> None:
    text = " ".join(_help("serve").split())
    assert "[SNOOZE_WORK_DIR; default: .snooze]" in text
    assert "[default: none, publish later]" in text
    assert "--target embedded|full" in text
    assert "Examples: snoozectl serve --models examples/models --no-auth" in text


def test_publish_names_idle_timeout_like_the_setting_and_shows_choices() -> None:
    text = " ".join(_help("publish").split())
    assert "--idle-timeout-secs, --idle-timeout" in text
    for choice in (
        "--device cpu|gpu|auto",
        "--keep-alive fixed|adaptive",
        "--worker in-stub|preforked",
        "--param KEY=VALUE",
        "--wakes MODEL",
    ):
        assert choice in text
    assert "Examples: snoozectl publish ./my-net --id my-net" in text


def test_status_has_examples_and_list_is_no_second_entry() -> None:
    top = _help()
    assert re.search(r"^\s+status\s", top, re.M)
    assert not re.search(r"^\s+list\s", top, re.M)  # a hidden old name of status
    assert "Examples:" in _help("status")
    assert RUNNER.invoke(app, ["list", "--help"]).exit_code == 0  # still works for scripts


def test_version() -> None:
    result = RUNNER.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"snoozectl {version('snoozeml')}"


def test_the_control_commands_default_to_the_api_port_a_serve_reads():
    """`snoozectl serve` takes its API port from SNOOZE_API_PORT: `status`, `publish` and the model commands look for
    the API there too, without --url (SNOOZE_API_URL or --url still say where)."""
    from controlplane.cli.control_client import default_url

    assert default_url({}) == "http://127.0.0.1:8080"
    assert default_url({"SNOOZE_API_PORT": "18100"}) == "http://127.0.0.1:18100"
    assert default_url({"SNOOZE_API_PORT": " "}) == "http://127.0.0.1:8080"
