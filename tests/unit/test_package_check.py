"""The import check of a custom package runs in a child process and reports what went wrong."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import psutil

from controlplane.package_check import check_import
from harness.probes import until

GOOD = """
import numpy as np


class Model:
    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        return {"y": np.asarray(inputs["x"])}
"""


def package(tmp_path: Path, source: str, name: str = "snooze_model.py", **extra: str) -> Path:
    folder = tmp_path / "pkg"
    folder.mkdir(exist_ok=True)
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(textwrap.dedent(source))
    for rel, text in extra.items():
        (folder / rel).write_text(textwrap.dedent(text))
    return folder


def test_a_good_package_passes_and_leaves_no_bytecode(tmp_path: Path) -> None:
    folder = package(tmp_path, GOOD)
    assert check_import(folder, "snooze_model.py", "Model") is None
    assert not (folder / "__pycache__").exists()


def test_sibling_modules_and_subfolder_entrypoints_import(tmp_path: Path) -> None:
    folder = package(
        tmp_path,
        "from helpers import scale\n\nclass Net:\n    load = predict = staticmethod(scale)\n",
        name="src/net.py",
        **{"helpers.py": "def scale(*a):\n    return a\n"},
    )
    assert check_import(folder, "src/net.py", "Net") is None


def test_import_error_reports_the_traceback_relative_to_the_package(tmp_path: Path) -> None:
    folder = package(tmp_path, "import os\nimport not_a_real_module_xyz\n\nclass Model: ...\n")
    problem = check_import(folder, "snooze_model.py", "Model")
    assert problem is not None
    assert problem.startswith("importing snooze_model.py failed:")
    assert 'File "snooze_model.py", line 2' in problem
    assert "ModuleNotFoundError: No module named 'not_a_real_module_xyz'" in problem
    assert str(folder) not in problem


def test_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    problem = check_import(package(tmp_path, "x = 1\ndef broken(:\n"), "snooze_model.py", "Model")
    assert problem is not None and "SyntaxError" in problem and "line 2" in problem


def test_missing_class_and_methods(tmp_path: Path) -> None:
    folder = package(tmp_path, "class Other: ...\n\nclass Half:\n    def load(self, d, dev): ...\n")
    assert check_import(folder, "snooze_model.py", "Model") == "snooze_model.py defines no class 'Model'"
    assert check_import(folder, "snooze_model.py", "Half") == "class Half in snooze_model.py has no predict method"


def test_manifest_env_is_applied_before_the_import(tmp_path: Path) -> None:
    folder = package(tmp_path, "import os\nassert os.environ['SNOOZE_TEST_FLAG'] == 'on'\n" + GOOD)
    assert check_import(folder, "snooze_model.py", "Model") is not None
    assert check_import(folder, "snooze_model.py", "Model", env={"SNOOZE_TEST_FLAG": "on"}) is None


def test_exit_at_import_is_reported(tmp_path: Path) -> None:
    problem = check_import(package(tmp_path, "import os\nos._exit(7)\n"), "snooze_model.py", "Model")
    assert problem == "importing snooze_model.py ended the process (exit code 7)"


def test_slow_import_times_out_and_its_processes_are_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    source = f"""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open({str(pid_file)!r}, "w").write(str(child.pid))
    time.sleep(60)
    """
    started = time.monotonic()
    problem = check_import(package(tmp_path, source), "snooze_model.py", "Model", timeout=2)
    assert time.monotonic() - started < 10
    assert problem is not None and "took longer than 2s" in problem and "inside load()" in problem
    grandchild = int(pid_file.read_text())
    until(lambda: not _alive(grandchild), "the import's own child to end with the timed-out import", 5, 0.05)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def test_one_probe_checks_many_packages_each_in_a_fresh_process(tmp_path: Path) -> None:
    """Same module name in every package: each job sees its own package, never the previous one's module or
    environment, and a job that times out leaves the probe answering the next."""
    from controlplane.package_check import probe_imports

    def job(name: str, source: str, **extra: object) -> dict:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "snooze_model.py").write_text(textwrap.dedent(source))
        return {
            "package_dir": str(folder),
            "entrypoint": "snooze_model.py",
            "class_name": "Model",
            "cwd": str(folder),
            **extra,
        }

    jobs = [
        job("good", GOOD, env={"SNOOZE_TEST_FLAG": "on"}),
        job("no-class", "import os\nassert 'SNOOZE_TEST_FLAG' not in os.environ\nclass Other: ...\n"),
        job("slow", "import time\ntime.sleep(30)\n", timeout=1),
        job("torch-free", "import sys\nsys.modules['torch'] = sys\nclass Model:\n    load = predict = print\n"),
        job("good-again", GOOD),
    ]
    good, no_class, slow, torch_free, good_again = probe_imports(jobs, workers=1)
    assert good["package"]["is_class"] and good["package"]["missing"] == []
    assert no_class["package"]["ok"] and not no_class["package"]["is_class"]
    assert slow == {"timeout": 1.0}
    assert torch_free["package"]["frameworks"] == ["torch"] and torch_free["package"]["before"] == []
    assert good_again["package"]["is_class"] and good_again["baseline"] == []


def test_missing_modules_finds_imports_inside_functions_and_skips_optional_ones(tmp_path: Path) -> None:
    from controlplane.package_check import missing_modules

    (tmp_path / "helpers").mkdir()
    (tmp_path / "helpers" / "__init__.py").write_text("")
    (tmp_path / "snooze_model.py").write_text(
        "import json\n"
        "import numpy as np\n"
        "import helpers\n"  # the package's own module
        "try:\n"
        "    import fancy_optional_accel\n"
        "except ImportError:\n"
        "    fancy_optional_accel = None\n"
        "class Model:\n"
        "    def load(self, model_dir, device):\n"
        "        import sklearnx\n"
        "        from torchx.nn import Linear\n"
        "        from . import helpers\n"
    )
    files = ["helpers/__init__.py", "snooze_model.py"]
    assert missing_modules(tmp_path, files) == [("snooze_model.py", 10, "sklearnx"), ("snooze_model.py", 11, "torchx")]
