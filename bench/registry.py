"""The bench's sections, found through one registry.

A section is one module under ``bench/sections/`` that builds a ``Section`` (its parameters for a full and a
``--quick`` run, its run, its markdown, summary and plot, the keys of its JSON) and passes it to ``register``.
``python -m bench`` and the report import every module of that package (``discover``) and take the sections from
here, in ``order``: the order they run in and the order the report shows them. A module whose measurement is
large keeps it in a module of its own (``bench/coldstart.py``, ...) and imports it inside ``run``, so that
discovering the sections loads no serving stack.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Data = dict[str, Any]
SECTIONS_PACKAGE = "bench.sections"


@dataclass(frozen=True)
class RunContext:
    """What a section's run may use besides its parameters."""

    results: Mapping[str, Data]  # the sections in this report so far (keepalive charges coldstart's cold starts)
    options: Mapping[str, Any] = field(default_factory=dict)  # command-line inputs: replay, cold_start_secs


@dataclass(frozen=True)
class Rendering:
    """What a section's markdown needs besides its data: the plots written for this report."""

    plots: Mapping[str, str]  # section name -> file name in the plot folder
    plot_rel: str  # the plot folder, relative to report.md

    def image(self, name: str, alt: str) -> list[str]:
        """The markdown lines of section ``name``'s plot, or none when it has none in this report."""
        return [f"![{alt}]({self.plot_rel}/{self.plots[name]})", ""] if name in self.plots else []


def _no_summary(data: Data) -> list[str]:
    return []


@dataclass(frozen=True)
class Section:
    """One bench section: its parameters, its run and its renderers."""

    name: str
    order: int  # where it runs and where the report shows it, among the others
    about: str  # one line for ``python -m bench --help``
    params: Mapping[str, Any]  # keyword arguments of a full run
    quick: Mapping[str, Any]  # of a ``--quick`` run
    run: Callable[[Path, dict[str, Any], RunContext], Coroutine[Any, Any, Data]]
    markdown: Callable[[Data, Rendering], list[str]]  # its part of report.md
    summary: Callable[[Data], list[str]] = _no_summary  # its bullets in the report's summary
    plot: Callable[[Data, Path], str] | None = None  # writes its plot to the path, returns the file name
    keys: frozenset[str] = frozenset()  # what its JSON holds at least: the run promises it, the renderers read it
    default: bool = True  # in a run without --only

    def missing(self, data: Data) -> list[str]:
        """The declared keys ``data`` lacks (a report.json written by an older bench)."""
        return sorted(self.keys - set(data))


class Registry:
    """Sections by name, in their order."""

    def __init__(self) -> None:
        self._sections: dict[str, Section] = {}
        self._discovered: set[str] = set()

    def register(self, section: Section) -> Section:
        taken = self._sections.get(section.name)
        if taken is not None and taken is not section:
            raise ValueError(f"bench section {section.name!r} is registered twice: rename one of them")
        if clash := [s.name for s in self._sections.values() if s.order == section.order and s.name != section.name]:
            raise ValueError(f"bench sections {section.name!r} and {clash[0]!r} share order {section.order}")
        self._sections[section.name] = section
        return section

    def unregister(self, name: str) -> None:
        self._sections.pop(name, None)

    def discover(self, package: str = SECTIONS_PACKAGE) -> Registry:
        """Import every module of ``package`` once; each registers its sections."""
        if package not in self._discovered:
            pkg = importlib.import_module(package)
            for info in pkgutil.iter_modules(pkg.__path__, f"{package}."):
                importlib.import_module(info.name)
            self._discovered.add(package)
        return self

    def sections(self) -> list[Section]:
        return sorted(self._sections.values(), key=lambda s: s.order)

    def names(self, *, default_only: bool = False) -> list[str]:
        return [s.name for s in self.sections() if s.default or not default_only]

    def get(self, name: str) -> Section:
        try:
            return self._sections[name]
        except KeyError:
            raise KeyError(f"no bench section {name!r}: one of {', '.join(self.names())}") from None


REGISTRY = Registry()
register = REGISTRY.register


def sections() -> Registry:
    """The registry with every module of ``bench/sections/`` imported."""
    return REGISTRY.discover()
