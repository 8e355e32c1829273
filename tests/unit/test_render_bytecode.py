"""A python-backend entry file is rendered with its bytecode (``render.with_bytecode``): the stub imports it
without writing into the model's folder. A file written there by a load is a change of the model's files to
Triton, which loads the model anew when a load next names it: an ensemble's load then replaced its steps'
instances, and the lifecycle took the ended stubs for crashes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from controlplane.render import with_bytecode

SOURCE = "import os\nANSWER = 42\n"


def _import_in_a_fresh_python(folder: Path, module: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}  # bytecode written as by default
    code = f"import sys; sys.path.insert(0, {str(folder)!r}); import {module}; print({module}.ANSWER)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_rendered_entry_is_imported_without_a_write_into_its_folder(tmp_path: Path) -> None:
    files = with_bytecode("1/model.py", SOURCE)
    assert set(files) == {"1/model.py", f"1/__pycache__/model.{sys.implementation.cache_tag}.pyc"}
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    os.utime(tmp_path / "1" / "model.py", (0, 0))  # a copy's mtime: the bytecode is checked by the source's hash
    before = _tree(tmp_path)
    assert _import_in_a_fresh_python(tmp_path / "1", "model") == "42"
    assert _tree(tmp_path) == before


def test_without_its_bytecode_the_first_import_writes_into_the_folder(tmp_path: Path) -> None:
    """What the rendered bytecode prevents (and what this test file would not see if imports never wrote)."""
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.py").write_text(SOURCE)
    assert _import_in_a_fresh_python(tmp_path / "1", "model") == "42"
    assert list((tmp_path / "1").rglob("*.pyc"))


def test_an_edited_entry_is_not_run_from_stale_bytecode(tmp_path: Path) -> None:
    for rel, data in with_bytecode("1/model.py", SOURCE).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    (tmp_path / "1" / "model.py").write_text(SOURCE.replace("42", "43"))
    assert _import_in_a_fresh_python(tmp_path / "1", "model") == "43"
