"""The docs name only what exists.

Every file path, dotted name (``module.function``, ``Class.method``, ``package.module.Name``), test, bench section
and ``python -m`` module that docs/internals.md, docs/measurements.md, docs/packages.md, docs/deploy.md and
README.md put in backticks is looked up in the tree: paths on disk, names by an AST scan of the project's sources
(no import: the scan sees attributes set in ``__init__`` too). The two contract pages are read strictly (every
dotted name, bare class and bare file name must be the project's); the user-facing pages leniently (a dotted name
is checked when it starts with one of the project's modules or classes). A citation of a section anywhere in the
repository (docs/<page>.md, "<section>") must name a heading of that page, and every relative link and anchor in
the docs must resolve. The last tests feed made-up names through the same checks: each must be reported.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("docs/internals.md", "docs/measurements.md", "docs/packages.md", "docs/deploy.md", "README.md")
# The contract pages are read strictly: every dotted name must be the project's (or an external root's below), and
# bare class and file names are checked too. In the others (user-facing: Kubernetes keys, Envoy runtime keys,
# entry-point groups), a dotted name is checked when its first part is one of the project's modules or classes.
CONTRACT_DOCS = ("docs/internals.md", "docs/measurements.md")
SOURCE_PACKAGES = ("controlplane", "python_backend", "converters", "bench", "tests", "examples")
# Folders of this tree a backticked path may start with; other paths (/proc/..., <repo>/...) are the machine's.
TREE_ROOTS = (*SOURCE_PACKAGES, "docs", "deploy", "model_repository_templates", ".ci")
# Names outside the project the docs may write as dotted names (standard library, third parties, the stub's module).
EXTERNAL_ROOTS = frozenset(
    {
        "np", "numpy", "os", "sys", "gc", "io", "time", "json", "signal", "asyncio", "torch", "onnx", "onnxruntime",
        "tritonclient", "pb_utils", "triton_python_backend_utils", "grpc", "httpx", "psutil", "threadpoolctl",
    }
)  # fmt: skip
# What a dotted span may end with when it is a file name rather than a Python name.
FILE_SUFFIXES = frozenset(
    {
        "py", "md", "json", "toml", "pbtxt", "onnx", "plan", "yaml", "yml", "j2", "lua", "c", "so", "bin", "log",
        "txt", "csv", "npz", "gz", "tgz", "zip", "tar", "sh", "cc", "data", "whl", "png", "pt", "parent", "worker",
        "journal", "phase", "warmup", "sequences", "ini", "cfg", "pem", "env", "io",
    }
)  # fmt: skip
BARE_CLASS_ALLOWED = frozenset({"Model"})  # the user's duck-typed class, defined by packages, not here
GENERATED_PATHS = frozenset({"bench/report.json"})  # written by ``python -m bench``, not committed

CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
CALL_TAIL = re.compile(r"\(.*\)$")
BARE_CLASS = re.compile(r"[A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CITATION = re.compile(r"docs/(\w+)\.md`{0,2}\s*(?:,|\()\s*\"([^\"]+)\"")


@dataclass
class Scope:
    """The names a module or a class defines: its members, and the classes among them (by name)."""

    names: set[str] = field(default_factory=set)
    classes: dict[str, Scope] = field(default_factory=dict)
    bases: list[str] = field(default_factory=list)  # a class's base classes, by name
    types: dict[str, str] = field(default_factory=dict)  # a class's annotated fields -> their class, by name


def _class_scope(node: ast.ClassDef) -> Scope:
    scope = Scope(
        bases=[
            b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))
        ]
    )
    for item in node.body:
        _define(scope, item)
    for sub in ast.walk(node):  # attributes set on self anywhere in its methods
        targets: list[ast.expr] = []
        if isinstance(sub, ast.Assign):
            targets = list(sub.targets)
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    scope.names.add(t.attr)
    return scope


def _define(scope: Scope, node: ast.stmt) -> None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        scope.names.add(node.name)
    elif isinstance(node, ast.ClassDef):
        scope.names.add(node.name)
        scope.classes[node.name] = _class_scope(node)
    elif isinstance(node, ast.Assign):
        for target in node.targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Name):
                    scope.names.add(t.id)
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        scope.names.add(node.target.id)
        if (kind := _annotated_class(node.annotation)) is not None:
            scope.types[node.target.id] = kind
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        scope.names.update((a.asname or a.name).split(".")[0] for a in node.names)
    elif isinstance(node, (ast.If, ast.Try)):  # TYPE_CHECKING blocks, optional imports
        handlers = [h.body for h in getattr(node, "handlers", [])]
        for part in (node.body, node.orelse, getattr(node, "finalbody", []), *handlers):
            for child in part:
                _define(scope, child)


def _annotated_class(annotation: ast.expr) -> str | None:
    """The class a field is annotated with, when it is one name (``memory: MemoryHeld``, or quoted)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    return annotation.id if isinstance(annotation, ast.Name) else None


@dataclass
class Tree:
    """The project's modules (dotted path -> scope) and its classes (name -> their scopes), read with ``ast``."""

    root: Path
    modules: dict[str, Scope]
    classes: dict[str, list[Scope]]
    tests: dict[str, set[str]]  # test file (relative path) -> its test functions
    bench_sections: frozenset[str]
    quoted: frozenset[str]  # identifiers the code writes as strings: protocol names (``"ModelStreamInfer"``)

    def modules_named(self, dotted: str) -> list[Scope]:
        """Modules whose dotted path is ``dotted`` or ends with it (``memory.plan``, ``journal``)."""
        return [s for m, s in self.modules.items() if m == dotted or m.endswith("." + dotted)]


def _member(tree: Tree, scope: Scope, parts: list[str], seen: frozenset[int] = frozenset()) -> bool:
    """``parts`` name a member of ``scope`` (or of a base class the tree defines), then of its class, and so on."""
    if not parts:
        return True
    head, rest = parts[0], parts[1:]
    if head not in scope.names:
        bases = [b for name in scope.bases for b in tree.classes.get(name, ()) if id(b) not in seen]
        return any(_member(tree, b, parts, seen | {id(scope)}) for b in bases)
    if not rest:
        return True
    inner = [scope.classes[head]] if head in scope.classes else tree.classes.get(scope.types.get(head, ""), [])
    return any(_member(tree, cls, rest) for cls in inner)


def read_tree(root: Path) -> Tree:
    modules: dict[str, Scope] = {}
    classes: dict[str, list[Scope]] = defaultdict(list)
    tests: dict[str, set[str]] = {}
    quoted: set[str] = set()
    for path in (root / "controlplane").rglob("*"):
        if path.suffix in (".py", ".lua", ".j2"):
            quoted.update(re.findall(r"[\"']([A-Za-z_]\w*)[\"']", path.read_text(encoding="utf-8")))
    for package in SOURCE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(rel))
            scope = Scope()
            for node in tree.body:
                _define(scope, node)
            # a package's submodules are its names too (``python_backend.spec``, ``lua.program``)
            modules[".".join(parts)] = scope
            for name, cls in scope.classes.items():
                classes[name].append(cls)
            if package == "tests":
                tests[rel.as_posix()] = {n for n in scope.names if n.startswith("test")} | {
                    f"{c}::{m}" for c, s in scope.classes.items() for m in s.names if m.startswith("test")
                }
    for dotted in list(modules):  # a package's submodules are members of the package
        parent, _, child = dotted.rpartition(".")
        if parent in modules:
            modules[parent].names.add(child)
    return Tree(root, modules, dict(classes), tests, _bench_sections(), frozenset(quoted))


def _bench_sections() -> frozenset[str]:
    from bench import registry

    return frozenset(registry.sections().names())


def resolves(tree: Tree, dotted: str) -> bool:
    """A dotted name defined in the tree: a module (or a suffix of its path) and its members, or a class's member."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if any(_member(tree, scope, parts[i:]) for scope in tree.modules_named(".".join(parts[:i]))):
            return True
    return any(_member(tree, cls, parts[1:]) for cls in tree.classes.get(parts[0], ()))


def code_spans(text: str) -> Iterable[tuple[int, str]]:
    """(line number, content) of every inline code span outside fenced blocks."""
    fenced = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.DOTALL | re.MULTILINE)
    for match in CODE_SPAN.finditer(fenced):
        yield fenced.count("\n", 0, match.start()) + 1, " ".join(match.group(2).split())


def headings(text: str) -> list[str]:
    fenced = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return [m.group(1) for line in fenced.splitlines() if (m := HEADING.match(line))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower())
    return text.replace(" ", "-")


def _tree_path(tree: Tree, token: str) -> str | None:
    """A problem with ``token`` if it is a path in this tree (``controlplane/x.py``, ``tests/a.py::test_b``)."""
    path, _, test = token.partition("::")
    path = path.rstrip("/.,;:")
    if not path.startswith(tuple(r + "/" for r in TREE_ROOTS)) and path not in TREE_ROOTS:
        return None
    if any(c in path for c in "<>{}$"):
        return None  # a template of a runtime path
    if path in GENERATED_PATHS:
        return None
    if not ("*" in path and any(tree.root.glob(path))) and not (tree.root / path).exists():
        return f"no such path: {path}"
    if test and test not in tree.tests.get(path, set()):
        return f"no test {test} in {path}"
    return None


def _bare_file(tree: Tree, token: str) -> str | None:
    """A problem with a bare file name of this project's code (``manager.py``, ``prefork_*.py``, ``hold.lua``)."""
    if "/" in token or not re.fullmatch(r"[\w*.\-]+\.(py|lua|j2|c)", token):
        return None
    found = [
        p for package in (*SOURCE_PACKAGES, "model_repository_templates") for p in (tree.root / package).rglob(token)
    ]
    return None if found else f"no file named {token} in the tree"


def problems_in(tree: Tree, text: str, *, strict: bool) -> list[str]:
    """Every backticked name in ``text`` that the tree does not hold, as 'line N: what' (``strict``: a contract
    page's reading, see ``CONTRACT_DOCS``)."""
    found = []
    for line, span in code_spans(text):
        for problem in _span_problems(tree, span, strict=strict):
            found.append(f"line {line}: `{span}`: {problem}")
    return found


def _ours(tree: Tree, root: str) -> bool:
    """``root`` is one of the project's modules (or a suffix of one's path) or classes."""
    return bool(tree.modules_named(root)) or root in tree.classes


def _span_problems(tree: Tree, span: str, *, strict: bool) -> Iterable[str]:
    for module in re.findall(r"python -m ([\w.]+)", span):
        if module.split(".")[0] in SOURCE_PACKAGES and module not in tree.modules:
            yield f"no module {module} to run"
    for section in re.findall(r"--only ([a-z_][\w,]*)", span):
        for name in section.split(","):
            if name not in tree.bench_sections:
                yield f"no bench section {name}"
    tokens = [t.strip("()[],;:'\"") for t in span.split()]
    for token in tokens:
        # in a command line, only what is plainly a file (a suffix, a test id): ``deploy/snooze`` is a resource there
        if len(tokens) > 1 and not re.search(r"\.\w+$|::", token):
            continue
        if (problem := _tree_path(tree, token) or (_bare_file(tree, token) if strict else None)) is not None:
            yield problem
    name = CALL_TAIL.sub("", span)
    if DOTTED.fullmatch(name):
        parts = name.split(".")
        checked = parts[0] not in EXTERNAL_ROOTS if strict else _ours(tree, parts[0])
        if parts[-1] not in FILE_SUFFIXES and checked and not resolves(tree, name):
            yield f"{name} is not defined in the tree"
    elif strict and BARE_CLASS.fullmatch(name) and name not in BARE_CLASS_ALLOWED | tree.quoted:
        if name not in tree.classes and not any(name in scope.names for scope in tree.modules.values()):
            yield f"no class {name} in the tree"


def link_problems(root: Path, doc: str, text: str) -> list[str]:
    """Relative links whose file or heading anchor does not exist."""
    found = []
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        file = (root / doc).parent / path if path else root / doc
        if not file.exists():
            found.append(f"link to a missing file: {target}")
        elif anchor and file.suffix == ".md" and anchor not in {slug(h) for h in headings(file.read_text())}:
            found.append(f"link to a missing heading: {target}")
    return found


def citation_problems(root: Path, name: str, text: str) -> list[str]:
    """``docs/<page>.md, "<section>"`` citations whose page has no heading starting with that section."""
    found = []
    for match in CITATION.finditer(text):
        page, section = root / "docs" / f"{match.group(1)}.md", match.group(2)
        if not page.exists():
            found.append(f"{name}: cites a missing page {page.relative_to(root)}")
        elif not any(h.replace("`", "").startswith(section) for h in headings(page.read_text())):
            found.append(f'{name}: cites {page.name}, "{section}", which has no such section')
    return found


@cache
def project_tree() -> Tree:
    return read_tree(ROOT)


@pytest.fixture(scope="module")
def tree() -> Tree:
    return project_tree()


@pytest.mark.parametrize("doc", DOCS)
def test_every_name_a_doc_puts_in_backticks_exists(tree: Tree, doc: str) -> None:
    problems = problems_in(tree, (ROOT / doc).read_text(), strict=doc in CONTRACT_DOCS)
    assert not problems, f"{doc} names what the tree does not hold (fix the doc, or the name):\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_and_anchor_of_a_doc_resolves(doc: str) -> None:
    problems = link_problems(ROOT, doc, (ROOT / doc).read_text())
    assert not problems, f"{doc}: " + "; ".join(problems)


def test_every_cited_docs_section_exists() -> None:
    problems = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in (".git", ".venv", ".venv310", "build", "dist") or rel.parts[0].endswith(".egg-info"):
            continue
        if path == Path(__file__):
            continue  # its made-up citations are test inputs
        if path.is_file() and path.suffix in (".py", ".md", ".lua", ".j2", ".toml", ".yaml", ".yml", ".sh", ".c"):
            problems += citation_problems(ROOT, rel.as_posix(), path.read_text(encoding="utf-8", errors="replace"))
    assert not problems, "sections cited that do not exist (name the heading as it is):\n" + "\n".join(problems)


def test_the_contract_page_stays_within_a_page_budget() -> None:
    lines = (ROOT / "docs" / "internals.md").read_text().count("\n")
    assert lines <= 400, f"docs/internals.md is {lines} lines: move figures to docs/measurements.md, history out"


# Made-up names, one of each kind; True: the user-facing pages' lenient reading catches it too (it names a path,
# module or class of the project), False: only a contract page's strict reading does.
MADE_UP = [
    ("`controlplane/lifecycle/nowhere.py`", True),
    ("`pytest tests/reliability/test_nowhere.py`", True),
    ("`tests/model/test_open_work.py::test_that_does_not_exist`", True),
    ("`Loader.no_such_method`", True),
    ("`controlplane.lifecycle.manager.nothing_here`", True),
    ("`memory.plan.NoSuchPlan`", True),
    ("`ModelRecord.memory.no_field`", True),
    ("`python -m bench.no_such_bench`", True),
    ("`python -m bench --only no_such_section`", True),
    ("`no_such_module_anywhere.py`", False),
    ("`nosuchpackage.function()`", False),
    ("`TransitionBroker`", False),
]


@pytest.mark.parametrize(("made_up", "lenient_too"), MADE_UP)
def test_a_made_up_name_is_reported(tree: Tree, made_up: str, lenient_too: bool) -> None:
    text = f"Some words {made_up} and more words."
    assert len(problems_in(tree, text, strict=True)) == 1
    assert len(problems_in(tree, text, strict=False)) == (1 if lenient_too else 0)


def test_real_names_of_each_kind_pass(tree: Tree) -> None:
    text = (
        "`controlplane/lifecycle/manager.py` `manager.py` `prefork_*.py` `Loader.load` `Unloads.evict`"
        " `controlplane.triton.processes.held_split` `memory.plan.Plan` `ModelRecord.in_use` `MemoryHeld.reserved`"
        " `python_backend.runtime_files` `lua.program` `tests/model/test_open_work.py` `python -m bench --only churn`"
        " `python -m bench.stub_unload wait 8` `os.environ` `snooze_model.json` `<repo>/<model>/config.pbtxt`"
        " `ModelStates` `LifecycleManager(clock=...)` `EnvoyGateway.drain`"  # drain: EnvoyProcess's, its base class
        " `ModelRecord.memory.reserved`"  # through the field's annotated class, MemoryHeld
    )
    assert problems_in(tree, text, strict=True) == []


def test_a_made_up_section_citation_and_anchor_are_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## Real section: more words\n")
    assert citation_problems(tmp_path, "x.py", 'see docs/page.md, "Real section"') == []
    assert citation_problems(tmp_path, "x.py", 'see docs/page.md ("Real section: more words")') == []
    assert len(citation_problems(tmp_path, "x.py", 'see docs/page.md, "Gone section"')) == 1
    assert len(citation_problems(tmp_path, "x.py", 'see docs/other.md, "Real section"')) == 1
    assert link_problems(tmp_path, "docs/page.md", "[a](page.md#real-section-more-words)") == []
    assert len(link_problems(tmp_path, "docs/page.md", "[a](page.md#gone-section)")) == 1
    assert len(link_problems(tmp_path, "docs/page.md", "[a](missing.md)")) == 1
