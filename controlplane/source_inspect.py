"""Reading user code without running it: ``ast`` walks over a package's Python source.

The control plane never imports user code; what it needs to know about that code (is ``predict`` a
generator, which modules does a file import, where is the export hook) is read from the parsed source here.
Standard library only.
"""

from __future__ import annotations

import ast
import functools
import threading
from collections.abc import Iterator

# CPython 3.11 keeps ``ast``'s conversion depth in one per-interpreter counter. Two threads converting at once (a
# garbage collection in one lets the other run) break each other's parse with ``SystemError: AST constructor
# recursion depth mismatch``; seen with concurrent publishes. Every parse here takes this lock. The standard
# library's own parses (3.11's traceback formatting) do not, so a parse that still meets the error is retried: the
# counter is reset at the start of every parse.
_PARSE_LOCK = threading.RLock()
_PARSE_TRIES = 3


def parse(source: str | bytes, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse``, one thread at a time, retried when another parse broke it (see ``_PARSE_LOCK``)."""
    for attempt in range(_PARSE_TRIES):
        try:
            with _PARSE_LOCK:
                return ast.parse(source, filename=filename)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == _PARSE_TRIES - 1:
                raise
    raise AssertionError("unreachable")


@functools.lru_cache(maxsize=64)  # asked several times per publish of one package (pure: the source's text)
def predict_is_generator(source: str, class_name: str) -> bool:
    """Whether ``class_name.predict`` in ``source`` is a generator function, read from the source
    (``ast``; the control plane never runs user code): a ``yield`` in its own body, not a nested one."""
    try:
        tree = parse(source)
    except SyntaxError:
        return False
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "predict":
                    return _yields(item)
    return False


def _yields(function: ast.AST) -> bool:
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))
    return False


def required_imports(source: str | bytes, *, filename: str = "<source>") -> Iterator[tuple[int, str]]:
    """(line, module) of absolute imports that are not guarded by ``except ImportError``. A file that does
    not parse raises SyntaxError (or ValueError, for null bytes) before anything is yielded."""
    return _required_imports(parse(source, filename=filename))


def _required_imports(tree: ast.AST) -> Iterator[tuple[int, str]]:
    guarded: set[int] = set()  # ids of nodes inside a try body whose handlers catch ImportError
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            guarded.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return handler.type is None or any(isinstance(k, ast.Name) and k.id in names for k in kinds)


def export_hook(source: str, class_name: str, *, filename: str = "<source>") -> str | None:
    """Where ``source`` defines the export hook (``class_name.export_module`` or a module-level
    ``export_module``, defined, assigned or imported); None when it does not. A syntax error propagates:
    the caller says which file is broken."""
    tree = parse(source, filename=filename)
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, functions) and node.name == "export_module":
            return "export_module()"
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            if any(isinstance(item, functions) and item.name == "export_module" for item in node.body):
                return f"{class_name}.export_module()"
        if isinstance(node, ast.Assign | ast.ImportFrom) and "export_module" in ast.unparse(node):
            return "export_module (assigned or imported)"
    return None
