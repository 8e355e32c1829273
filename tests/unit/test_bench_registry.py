"""The bench's section registry (bench/registry.py): a section is one module that registers itself; `python -m bench`
runs it from there, the report renders it, and a report whose data lacks it (or lacks what it reads) still renders.

The sections here are the test's own: a run that returns a number, no server (the real sections run in
tests/integration/test_bench_smoke.py)."""

from __future__ import annotations

import json
import pkgutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import bench.sections
from bench import report
from bench.__main__ import main
from bench.registry import REGISTRY, Data, Rendering, RunContext, Section, register, sections

TOY = "toy"
# Every section the bench had when the registry came: each must still be found.
KNOWN = {
    "gateway", "gateway_filters", "gateway_targets", "gateway_routes", "envoy_cpu", "envoy_instructions", "coldstart",
    "batching", "scale_to_zero", "scale", "recovery", "streaming", "keepalive", "keepalive_replay", "keepalive_live",
    "fleet", "eviction", "churn", "native",
}  # fmt: skip


async def _toy_run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    return {"value": params["value"], "earlier": sorted(ctx.results)}


def _toy_markdown(data: Data, rendering: Rendering) -> list[str]:
    return ["## Toy section", "", f"value {data['value']}", "", *rendering.image(TOY, "toy")]


def _toy_plot(data: Data, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not really a png")
    return path.name


def _section(name: str = TOY, **changes: Any) -> Section:
    fields: dict[str, Any] = dict(
        name=name, order=10_000, about="a test's section", params={"value": 2}, quick={"value": 1}, run=_toy_run,
        markdown=_toy_markdown, summary=lambda data: [f"- **Toy**: {data['value']}"], plot=_toy_plot,
        keys=frozenset({"value"}), default=False,
    )  # fmt: skip
    return Section(**{**fields, **changes})


@pytest.fixture
def toy() -> Iterator[Section]:
    sections()  # the real ones first: the toy is registered beside them
    section = register(_section())
    yield section
    REGISTRY.unregister(TOY)


def _results(**sections: Data) -> dict[str, Any]:
    """What a report.json holds, with ``sections`` as its data."""
    machine = {"cpu_model": "cpu", "cores": 2, "memory_gib": 4.0, "python": "3.11", "platform": "linux",
               "load_average": [0.1, 0.1, 0.1]}  # fmt: skip
    return {
        "command": "python -m bench", "started": "2026-01-01T00:00:00+00:00", "wall_s": 1.0, "machine": machine,
        "load_average_end": [0.1, 0.1, 0.1], "quick": False, "failed": [], "sections": sections,
        "section_meta": {name: {"wall_s": 1.0, "finished": "2026-01-01T00:00:01+00:00"} for name in sections},
    }  # fmt: skip


def test_every_module_of_bench_sections_registers_and_every_section_is_found() -> None:
    registry = sections()
    assert KNOWN <= set(registry.names())
    modules = {info.name for info in pkgutil.iter_modules(bench.sections.__path__, "bench.sections.")}
    assert {s.run.__module__ for s in registry.sections()} == modules  # no module that registers nothing
    orders = [s.order for s in registry.sections()]
    assert len(set(orders)) == len(orders)
    assert "keepalive" in registry.names(default_only=True)
    assert "keepalive_replay" not in registry.names(default_only=True)  # it needs --replay
    assert all(s.about and s.markdown for s in registry.sections())


def test_a_registered_section_is_run_by_the_cli_and_rendered_with_its_summary_and_plot(
    toy: Section, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert main(["--only", TOY, "--out-dir", str(out)]) == 0
    data = json.loads((out / "report.json").read_text())
    assert data["sections"] == {TOY: {"value": 2, "earlier": []}} and data["failed"] == []
    assert data["command"] == "python -m bench --only toy" and TOY in data["section_meta"]
    text = (out / "report.md").read_text()
    assert "## Toy section\n\nvalue 2\n" in text
    assert "- **Toy**: 2" in text.split("## Summary", 1)[1].split("## Toy section", 1)[0]
    assert "![toy](plots/toy.png)" in text and (out / "plots" / "toy.png").is_file()
    # --quick takes the section's quick parameters
    assert main(["--only", TOY, "--quick", "--out-dir", str(tmp_path / "quick")]) == 0
    assert json.loads((tmp_path / "quick" / "report.json").read_text())["sections"][TOY]["value"] == 1


def test_only_merges_into_the_report_json_it_finds_and_keeps_sections_it_did_not_run(
    toy: Section, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    earlier = _results(unknown_now={"x": 1})  # a section this bench no longer has
    (out / "report.json").write_text(json.dumps(earlier))
    assert main(["--only", TOY, "--out-dir", str(out)]) == 0
    data = json.loads((out / "report.json").read_text())
    assert data["sections"]["unknown_now"] == {"x": 1} and data["sections"][TOY]["earlier"] == ["unknown_now"]
    text = (out / "report.md").read_text()
    assert "## Toy section" in text and "unknown_now 1 s" not in text  # kept in the data, not rendered


def test_a_section_absent_from_the_data_is_left_out_and_one_lacking_its_keys_says_so(toy: Section) -> None:
    without = report.markdown(_results(), {}, "plots")
    assert "Toy" not in without and without.startswith("# snoozeml benchmark report")
    assert "Toy" not in report.markdown(_results(toy={}), {}, "plots")
    old = report.markdown(_results(toy={"other": 1}), {}, "plots")
    assert "Not rendered: this report's data for toy lacks value" in old and "python -m bench --only toy" in old
    assert "- **Toy**" not in old  # its summary reads the same keys
    assert report.write_plots(_results(), Path("/nonexistent")) == {}  # no data, no plot drawn


def test_a_run_that_returns_less_than_its_section_declares_fails_that_section_only(
    toy: Section, tmp_path: Path
) -> None:
    async def half(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
        return {"something": 1}

    register(_section("half", order=10_001, run=half))
    try:
        out = tmp_path / "out"
        assert main(["--only", TOY, "--only", "half", "--out-dir", str(out)]) == 1
    finally:
        REGISTRY.unregister("half")
    data = json.loads((out / "report.json").read_text())
    assert set(data["sections"]) == {TOY}
    assert data["failed"] == ["half: RuntimeError: its run returned no value, which its section declares in keys"]
    assert "## Failed sections\n\n- half: RuntimeError" in (out / "report.md").read_text()


def test_a_module_dropped_into_a_sections_package_is_discovered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "more_sections"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "dropped.py").write_text(
        "from bench.registry import Section, register\n"
        "async def run(root, params, ctx):\n"
        "    return {}\n"
        "register(Section(name='dropped', order=10_002, about='dropped in', params={}, quick={}, run=run,\n"
        "                 markdown=lambda data, rendering: []))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert "dropped" in REGISTRY.discover("more_sections").names()
        with pytest.raises(ValueError, match="'dropped' is registered twice"):
            register(_section("dropped", order=10_003))
    finally:
        REGISTRY.unregister("dropped")
        sys.modules.pop("more_sections.dropped", None)
        sys.modules.pop("more_sections", None)
