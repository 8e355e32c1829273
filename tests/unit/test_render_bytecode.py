"""A python model's version folder gets a file named ``__pycache__`` (``render.no_bytecode``): no Python, whatever its
version, writes bytecode into the model's folder. A file written there by a load is a change of the model's files to
Triton, which loads the model anew when a load next names it: an ensemble's load then replaced its steps' instances,
and the lifecycle took the ended stubs for crashes. The stub's Python runs isolated, so ``PYTHONDONTWRITEBYTECODE``
in its environment does nothing; the official image's stub runs Python 3.10, another version than the control
plane's."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.render import no_bytecode, python_entry

SOURCE = "import os\nANSWER = 42\n"


def _pythons() -> list[object]:
    """This interpreter, and a 3.10 one as the official image's stub runs (named as a skip where there is none)."""
    pyenv = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10")))
    found = pyenv[-1] if pyenv else shutil.which("python3.10")  # a pyenv shim of PATH may name no version
    missing = pytest.mark.skip(reason="no python3.10 on PATH or under ~/.pyenv/versions")
    py310 = pytest.param(found, id="python3.10", marks=() if found else missing)
    return [pytest.param(sys.executable, id="this-python"), py310]


def _import_in_a_fresh_python(python: str, folder: Path, module: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}  # bytecode written as by default
    code = f"import sys; sys.path.insert(0, {str(folder)!r}); import {module}; print({module}.ANSWER)"
    done = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _write(folder: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)


@pytest.mark.parametrize("python", _pythons())
def test_an_entry_beside_its_pycache_file_is_imported_without_a_write_into_its_folder(
    tmp_path: Path, python: str
) -> None:
    _write(tmp_path, {"1/model.py": SOURCE.encode(), "1/helper.py": b"ANSWER = 7\n", **no_bytecode("1")})
    before = _tree(tmp_path)
    assert _import_in_a_fresh_python(python, tmp_path / "1", "model") == "42"
    assert _import_in_a_fresh_python(python, tmp_path / "1", "helper") == "7"  # a module of the user's, too
    assert _tree(tmp_path) == before and sorted(p.name for p in (tmp_path / "1").iterdir()) == sorted(
        ["model.py", "helper.py", "__pycache__"]
    )


@pytest.mark.parametrize("python", _pythons())
def test_without_it_the_first_import_writes_into_the_folder(tmp_path: Path, python: str) -> None:
    """What the file prevents (and what this test file would not see if imports never wrote)."""
    _write(tmp_path, {"1/model.py": SOURCE.encode()})
    assert _import_in_a_fresh_python(python, tmp_path / "1", "model") == "42"
    assert list((tmp_path / "1").rglob("*.pyc"))


def test_the_rendered_entry_comes_with_it_and_names_no_model() -> None:
    files = python_entry("1")
    assert set(files) == {"1/model.py", "1/__pycache__"} and files["1/__pycache__"] == b""
