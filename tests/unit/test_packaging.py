"""A non-editable install must carry the templates, the python-backend runtime and the gateway
bootstrap: they are data read at run time, not only modules."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_contains_runtime_data(tmp_path: Path) -> None:
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    source = tmp_path / "src"
    for rel in tracked.splitlines():
        if (ROOT / rel).is_file():
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, source / rel)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-v",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    # setuptools >= 77 (the build requirement) warns on a license given as a TOML table, at every install
    assert "project.license` as a TOML table is deprecated" not in built.stdout + built.stderr
    (wheel,) = tmp_path.glob("snoozeml-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "model_repository_templates/python.pbtxt.j2",
        "model_repository_templates/onnxruntime.pbtxt.j2",
        "model_repository_templates/tensorrt.pbtxt.j2",
        "model_repository_templates/_tensors.pbtxt.j2",
        "model_repository_templates/python_model.py.j2",
        "model_repository_templates/_bytecode.py.j2",
        "python_backend/triton_model.py",
        "controlplane/gateway/envoy.yaml.j2",
        "converters/onnx_inspect.py",
    }
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    assert not any(n.startswith("tests/") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "snoozectl = controlplane.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
