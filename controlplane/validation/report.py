"""`snoozectl validate`'s results and their formats: the report (table, JSON, JUnit XML) and the recorder
that writes every failure as model, file, problem and fix."""

from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

OK, FAIL, SKIP, WARN = "ok", "fail", "skip", "warn"  # a warning passes (unless --strict made it a fail)
REPOSITORY = "(repository)"


@dataclass
class CheckResult:
    """One check of one model. ``message`` is complete on its own: model, file, problem and fix."""

    model: str
    check: str
    status: str  # ok | fail | skip | warn
    message: str
    file: str | None = None  # relative to the repository
    fix: str | None = None
    load_secs: float | None = None

    @property
    def ok(self) -> bool:
        return self.status != FAIL

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ok": self.ok}


@dataclass
class ValidationReport:
    repository: str
    target: str
    load: bool
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.ok]

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(r.model for r in self.results if r.model != REPOSITORY))

    def for_model(self, model: str) -> list[CheckResult]:
        return [r for r in self.results if r.model == model]

    @property
    def load_secs(self) -> dict[str, float]:
        """Per-model load time of the models that loaded."""
        return {r.model: r.load_secs for r in self.results if r.check == "load" and r.load_secs is not None}

    def to_dict(self) -> dict[str, Any]:
        return {
            "repository": self.repository,
            "target": self.target,
            "load": self.load,
            "ok": self.ok,
            "models": self.models,
            "failures": len(self.failures),
            "load_secs": self.load_secs,
            "results": [r.to_dict() for r in self.results],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_junit_xml(self) -> str:
        """JUnit XML: one testsuite per model, one testcase per check (load time as the case's time)."""
        root = ET.Element(
            "testsuites", name="snoozectl validate", tests=str(len(self.results)), failures=str(len(self.failures))
        )
        for model in dict.fromkeys(r.model for r in self.results):
            cases = self.for_model(model)
            suite = ET.SubElement(
                root,
                "testsuite",
                name=f"snoozeml.validate.{model}",
                tests=str(len(cases)),
                failures=str(sum(not c.ok for c in cases)),
                skipped=str(sum(c.status == SKIP for c in cases)),
                time=f"{sum(c.load_secs or 0.0 for c in cases):.3f}",
            )
            for c in cases:
                case = ET.SubElement(
                    suite,
                    "testcase",
                    classname=f"snoozeml.validate.{model}",
                    name=c.check,
                    time=f"{c.load_secs or 0.0:.3f}",
                )
                if c.file:
                    case.set("file", c.file)
                if c.status == FAIL:
                    ET.SubElement(case, "failure", message=c.message, type=c.check).text = c.message
                elif c.status == SKIP:
                    ET.SubElement(case, "skipped", message=c.message)
                else:
                    ET.SubElement(case, "system-out").text = c.message
        ET.indent(root)
        return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"

    def write_junit_xml(self, path: str | os.PathLike[str]) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(self.to_junit_xml(), encoding="utf-8")
        return out

    def print_table(self, console: Any = None, *, verbose: bool = False) -> None:
        """A human table: one row per passing model, one row per failed or skipped check
        (every check with ``verbose``)."""
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        table = Table(title=f"snoozectl validate {self.repository} (target {self.target})")
        for col in ("model", "check", "status", "load s", "message"):
            table.add_column(col, overflow="fold")
        style = {OK: "green", FAIL: "bold red", SKIP: "yellow", WARN: "yellow"}
        for model in dict.fromkeys(r.model for r in self.results):
            results = self.for_model(model)
            load = next((r.load_secs for r in results if r.load_secs is not None), None)
            load_text = f"{load:.2f}" if load is not None else ""
            shown = results if verbose else [r for r in results if r.status != OK]
            if not verbose:
                passed = sum(r.status == OK for r in results)
                table.add_row(
                    model,
                    "(all)",
                    f"[{style[OK]}]ok[/]" if all(r.ok for r in results) else f"[{style[FAIL]}]fail[/]",
                    load_text,
                    f"{passed}/{len(results)} checks passed",
                )
            for r in shown:
                table.add_row(
                    model,
                    r.check,
                    f"[{style[r.status]}]{r.status}[/]",
                    f"{r.load_secs:.2f}" if r.load_secs is not None else "",
                    r.message,
                )
        console.print(table)
        n_models = len(self.models)
        if self.ok:
            warned = sum(r.status == WARN for r in self.results)
            console.print(
                f"[green]OK[/]: {n_models} model(s), {len(self.results)} checks, none failed"
                + (f", {warned} warning(s)" if warned else "")
            )
        else:
            console.print(
                f"[bold red]FAILED[/]: {len(self.failures)} of {len(self.results)} checks "
                f"failed across {n_models} model(s)"
            )


def _own_words(problem: str, model: str, file: str | None) -> str:
    """``problem`` less a leading ``model '<model>' (<where>):`` of its own (an error raised for the same model
    names it first), keeping its ``<where>`` only when the result names no file of its own."""
    head = f"model '{model}'"
    if not problem.startswith(head):
        return problem
    found = re.match(r"\s*(\(([^)]*)\))?:\s*", problem[len(head) :])
    if found is None:
        return problem
    rest = problem[len(head) + found.end() :]
    return f"{found.group(2)}: {rest}" if found.group(2) and not file else rest


class Recorder:
    """Collects the results of one model; builds messages that name the model, file and fix."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.results: list[CheckResult] = []

    def ok(self, check: str, message: str, file: str | None = None, load_secs: float | None = None) -> None:
        self.results.append(CheckResult(self.model, check, OK, message, file, None, load_secs))

    def skip(self, check: str, message: str, file: str | None = None) -> None:
        self.results.append(CheckResult(self.model, check, SKIP, message, file))

    def fail(self, check: str, problem: str, *, file: str | None, fix: str, status: str = FAIL) -> None:
        where = f" ({file})" if file else ""
        message = f"model '{self.model}'{where}: {_own_words(problem, self.model, file)}"
        # A problem that already says its fix (a SnoozeError's message with its hint) is not told it twice.
        message += "" if fix.rstrip(".") in problem else f". Fix: {fix}"
        self.results.append(CheckResult(self.model, check, status, message, file, fix))

    def warn(self, check: str, problem: str, *, file: str | None, fix: str) -> None:
        """A problem that does not fail the gate (validate --strict makes it a failure)."""
        self.fail(check, problem, file=file, fix=fix, status=WARN)

    @property
    def failed(self) -> bool:
        return any(not r.ok for r in self.results)
