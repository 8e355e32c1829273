"""examples/ci: the GitHub Actions workflow parses and calls snoozectl with flags that exist."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

yaml = pytest.importorskip("yaml")

WORKFLOW = Path(__file__).resolve().parents[2] / "examples" / "ci" / "validate-model-repository.yml"


def _snoozectl_calls() -> list[list[str]]:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    steps = workflow["jobs"]["validate"]["steps"]
    calls = []
    for step in steps:
        for line in step.get("run", "").replace("\\\n", " ").splitlines():
            words = shlex.split(line)
            if words[:1] == ["snoozectl"]:
                calls.append(words[1:])
    return calls


def test_workflow_installs_embedded_and_runs_render_then_validate() -> None:
    text = WORKFLOW.read_text()
    assert 'pip install "snoozeml[embedded]"' in text
    calls = _snoozectl_calls()
    assert [c[0] for c in calls] == ["render", "validate"]
    render, validate = calls
    out = render[render.index("--out") + 1]
    assert validate[1] == out  # validates what it rendered
    assert "--load" in validate and "--junit-xml" in validate


def test_workflow_flags_exist_in_the_cli() -> None:
    from controlplane.cli import app

    runner = CliRunner()
    for call in _snoozectl_calls():
        result = runner.invoke(app, [call[0], "--help"])
        assert result.exit_code == 0, result.output
        for word in call[1:]:
            if word.startswith("--"):
                assert word in result.output, f"snoozectl {call[0]} has no {word}"
