"""The README's quick start, run as written: the stack `make serve` starts (examples/models, --no-auth),
the client snippet with the documented interpreter (`.venv/bin/python`), then the shell lines
(`snoozectl status`, `snoozectl publish ./my-net`, `curl .../metrics`), and Ctrl-C. One stack for the
module; the README's own text is what runs, so the docs and the behaviour cannot drift apart."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from controlplane.child_processes import wait_gone
from harness.serve import Serve, is_alive

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
EXAMPLES = ROOT / "examples" / "models"


def quick_start() -> str:
    text = README.read_text()
    return text[text.index("## Quick start") : text.index("\n## ", text.index("## Quick start") + 1)]


def code_blocks(section: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", section, re.S | re.M)


def shell_lines(body: str) -> list[str]:
    """The commands of a shell block, without their trailing `# comments` (shlex keeps quoted #)."""
    lines = []
    for line in body.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            lines.append(line.split("  #")[0].strip() if "  #" in line else line.strip())
    return lines


class MakeServe(Serve):
    """`make serve` as the README runs it: in a fresh copy of the repository, from its root, the Makefile's
    own command line (`--work-dir .snooze`, relative). Only the ports move, through the SNOOZE_* variables
    the command reads (README, "Settings"); `.venv` is a link to this interpreter's environment."""

    def __init__(self, clone: Path, env: dict[str, str]) -> None:
        super().__init__(clone / ".snooze", env)
        self.clone = clone
        self.log = clone.parent / "make-serve.log"
        self.env = {**env, "SNOOZE_HTTP_PORT": str(self.http_port), "SNOOZE_GRPC_PORT": str(self.grpc_port),
                    "SNOOZE_API_PORT": str(self.api_port)}  # fmt: skip

    def start(self, timeout: float = 60.0, *, ready: bool = False) -> float:
        started = time.monotonic()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(["make", "serve"], cwd=self.clone, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env, start_new_session=True)  # fmt: skip
        health = f"{self.api_url}/health/{'ready' if ready else 'live'}"
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"make serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(health, timeout=2).status_code == 200:
                    break
            if time.monotonic() - started > timeout:
                raise AssertionError(f"make serve not up within {timeout:g}s:\n{self.log_tail()}")
            time.sleep(0.2)
        self.descendants()
        return time.monotonic() - started

    def leftovers(self) -> list[psutil.Process]:
        """Also what runs from the copy (Envoy and Triton run in sessions of their own)."""
        found = {p.pid: p for p in super().leftovers()}
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.pid not in found and is_alive(p) and Path(p.cwd()).is_relative_to(self.clone):
                    found[p.pid] = p
        return list(found.values())


def _fresh_clone(dest: Path) -> Path:
    """The repository's tracked files as they are in this tree (a clone of it with uncommitted edits), with
    their times, so that make sees `.venv`'s install stamps as up to date."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, tracked.decode().split("\0")):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    (dest / ".venv").symlink_to(Path(sys.prefix))
    return dest


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's fresh clone, with a package of their own, `./my-net`, copied from the numpy example as the
    README suggests."""
    if not shutil.which("make") or not (ROOT / ".git").exists():
        pytest.skip("needs make and a git checkout")
    home = _fresh_clone(tmp_path_factory.mktemp("user") / "snoozeml")
    plan = subprocess.run(["make", "-n", "serve"], cwd=home, capture_output=True, text=True, timeout=60)
    if "pip" in plan.stdout or "-m venv" in plan.stdout:  # it would reinstall into this very environment
        pytest.skip(f"{sys.prefix} is older than pyproject.toml or lacks torch: run `make install-dev` first")
    shutil.copytree(EXAMPLES / "numpy-linear", home / "my-net", ignore=shutil.ignore_patterns("__pycache__"))
    return home


@pytest.fixture(scope="module")
def stack(user_dir: Path) -> Iterator[Serve]:
    """`make serve`, run from the fresh clone: --models examples/models --work-dir .snooze --no-auth."""
    recipe = re.search(r"^serve:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert recipe is not None
    assert "snoozectl serve --models examples/models --work-dir .snooze" in recipe.group(1), recipe.group(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SNOOZE_")}
    serve = MakeServe(user_dir, env)
    try:
        serve.start(timeout=240, ready=True)  # make also generates the ONNX example (make examples)
        yield serve
    finally:
        serve.stop()


def _expected_numpy_linear(x: np.ndarray) -> np.ndarray:
    spec = importlib.util.spec_from_file_location("readme_numpy_linear", EXAMPLES / "numpy-linear" / "snooze_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.Model(scale=2.0)  # the example's manifest params
    model.load(str(EXAMPLES / "numpy-linear"), "cpu")
    return model.predict({"x": x})["y"]


def _run_the_client_snippet(stack: Serve, user_dir: Path) -> subprocess.CompletedProcess[str]:
    """The README's client, saved as client.py in the user's folder and run as it says, against this stack."""
    section = quick_start()
    assert "`.venv/bin/python client.py`" in section  # the documented way to run it
    (snippet,) = [body for lang, body in code_blocks(section) if lang == "python"]
    assert '"localhost:8000"' in snippet
    (user_dir / "client.py").write_text(snippet.replace('"localhost:8000"', f'"localhost:{stack.http_port}"'))
    return subprocess.run([".venv/bin/python", "client.py"], cwd=user_dir, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_the_client_snippet_runs_with_the_documented_interpreter(stack: Serve, user_dir: Path) -> None:
    proc = _run_the_client_snippet(stack, user_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(_expected_numpy_linear(np.ones((2, 4), dtype=np.float32)))


def test_the_shell_lines_run_as_written(stack: Serve, user_dir: Path) -> None:
    # in the README's order: the client first (it wakes numpy-linear), then the lines that show it
    assert _run_the_client_snippet(stack, user_dir).returncode == 0
    section = quick_start()
    blocks = [body for lang, body in code_blocks(section) if lang == ""]
    make, after = blocks[0], blocks[1]
    assert shell_lines(make) == ["make serve", "make test"]
    commands = shell_lines(after)
    assert [c.split()[:2] for c in commands] == [
        [".venv/bin/snoozectl", "status"],
        [".venv/bin/snoozectl", "publish"],
        ["curl", "-s"],
        ["curl", "-s"],
    ]
    # The ports are this stack's; the commands are the README's.
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # piped, no terminal width: as in a CI log
    env["SNOOZE_API_URL"] = stack.api_url
    outputs = []
    for command in commands:
        command = command.replace("localhost:8080", f"localhost:{stack.api_port}")
        proc = subprocess.run(["bash", "-c", command], cwd=user_dir, env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 0, (command, proc.stdout, proc.stderr)
        outputs.append(proc.stdout)
    status, published, listing, metrics = outputs
    assert [m["id"] for m in json.loads(listing)] == ["my-net"], listing  # the prefix filter: only my-net
    assert re.search(r"numpy-linear\s.*ready", status), status  # woken by the client
    assert re.search(r"┃ model .* ┃ last cold start ┃$", status, re.M), status  # whole rows, not cut at 80 columns
    assert published.strip() == "published my-net (custom, python backend)"  # and nothing else
    assert 'snooze_cold_starts_total{model="numpy-linear",trigger="request"} 1.0' in metrics, metrics
    assert re.search(r'^nv_inference_request_success\{model="numpy-linear",version="1"\} [1-9]', metrics, re.M)


def _shape_error(client_module, url: str, model: str, arrays: dict[str, np.ndarray]) -> str:
    """The message of the error an infer call with these arrays gets (HTTP or gRPC client)."""
    with client_module.InferenceServerClient(url) as client:
        inputs = []
        for name, array in arrays.items():
            inp = client_module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            inp.set_data_from_numpy(array)
            inputs.append(inp)
        with pytest.raises(InferenceServerException) as err:
            client.infer(model, inputs)
    if client_module is grpcclient:
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    return err.value.message()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_wrong_shape_keeps_tritons_words_first_then_says_what_to_send(stack: Serve, protocol: str) -> None:
    client_module, url = (httpclient, stack.http_url) if protocol == "http" else (grpcclient, stack.grpc_url)

    def call(url: str, model: str, arrays: dict[str, np.ndarray]) -> str:
        return _shape_error(client_module, url, model, arrays)

    # numpy-linear declares x with dims [4] and batches: [2, 3] is a wrong item shape, [4] lacks the batch axis
    for shape, got in (((2, 3), "2,3"), ((4,), "4")):
        message = call(url, "numpy-linear", {"x": np.ones(shape, np.float32)})
        first, _, last = message.rpartition("\n")
        assert "unexpected shape for input 'x' for model 'numpy-linear'. Expected [-1,4], got [" + got + "]" in first
        assert "NOTE: Setting a non-zero max_batch_size" in first  # Triton's message, whole
        assert last == (
            "snoozeml: model 'numpy-linear' declares input 'x' with dims [4] (without the batch axis; -1 = any "
            f"size): send shape [n,4], n items in the request (n = 1 for one item), not [{got}]"
        ), message
    # text-features has three inputs: one with another first axis
    arrays = {"values": np.ones((2, 4), np.float32), "factor": np.ones((1, 1), np.int64),
              "text": np.array([[b"a"], [b"b"]], dtype=object)}  # fmt: skip
    message = call(url, "text-features", arrays)
    first, _, last = message.rpartition("\n")
    assert "batch size does not match other inputs for 'text-features'" in first, message
    assert last.startswith("snoozeml: the first axis of every input of model 'text-features' is the batch"), message


def test_readme_links_stay_inside_the_repository() -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text()):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).resolve().is_relative_to(ROOT) and (ROOT / target).exists(), target


def _streaming_examples() -> tuple[str, str]:
    """The README's two streaming examples: the gRPC client (python) and the SSE curl line."""
    text = README.read_text()
    start = text.index("### Streaming models")
    end = re.compile(r"^##{1,2} ", re.M).search(text, start + 1)  # the next section, "##" or "###"
    section = text[start : end.start() if end else len(text)]
    blocks = code_blocks(section)
    (client,) = [body for lang, body in blocks if lang == "python"]
    (curl,) = [line for lang, body in blocks if lang == "" for line in shell_lines(body)]
    return client, curl


def test_the_streaming_examples_run_as_written(stack: Serve, user_dir: Path) -> None:
    client, curl = _streaming_examples()
    assert '"localhost:8001"' in client and "localhost:8000" in curl
    (user_dir / "stream.py").write_text(client.replace('"localhost:8001"', f'"localhost:{stack.grpc_port}"'))
    proc = subprocess.run([".venv/bin/python", "stream.py"], cwd=user_dir, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    assert 1 <= len(words) <= 20 and "error" not in proc.stdout.lower(), proc.stdout  # tokens, then the end
    proc = subprocess.run(["bash", "-c", curl.replace("localhost:8000", f"localhost:{stack.http_port}")],
                          cwd=user_dir, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    events = [line for line in proc.stdout.splitlines() if line.startswith("data:")]
    assert events and all('"token"' in e for e in events), proc.stdout


def _make_test_prerequisites() -> list[str]:
    prerequisites = re.search(r"^test: (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert prerequisites is not None
    steps = prerequisites.group(1).split()
    assert steps == ["install-dev", "examples", "test-runtime-py310"], steps
    return steps


@pytest.mark.parametrize(
    "steps",
    [pytest.param(slice(0, 2), id="install-dev+examples"),
     # the 3.10 runtime tests build a .venv310 in the clone and run what `make test` runs anyway: 40 s here
     pytest.param(slice(2, 3), id="test-runtime-py310", marks=pytest.mark.slow)],
)  # fmt: skip
def test_make_tests_first_steps_run_in_the_fresh_clone(user_dir: Path, steps: slice) -> None:
    """`make test` less its last step (the suite itself, which is what runs this): its prerequisites, as
    make runs them from the clone's root."""
    targets = _make_test_prerequisites()[steps]
    proc = subprocess.run(["make", *targets], cwd=user_dir, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if "test-runtime-py310" in targets:
        assert re.search(r"\d+ passed", proc.stdout) or "SKIPPED (no python3.10" in proc.stdout, proc.stdout


@pytest.mark.stops_stack
def test_ctrl_c_stops_everything_and_says_so_last(stack: Serve) -> None:
    """Ctrl-C in make's terminal: SIGINT to its whole process group (make and snoozectl)."""
    assert stack.proc is not None
    stack.descendants()
    os.killpg(stack.proc.pid, signal.SIGINT)
    stack.proc.wait(90)  # make reports the interrupt with an exit code of its own
    last = [line for line in stack.log_tail(10).splitlines() if not line.startswith("make")][-1]
    assert last.startswith("stopped: gateway, control plane and Triton exited"), stack.log_tail()
    assert wait_gone(stack.leftovers(), 30)[1] == [], stack.log_tail()
