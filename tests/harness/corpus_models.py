"""Packages of the model corpus (tests/integration/test_corpus.py), each with one request and the answer its
framework gives in-process. Built without downloading anything: torch architectures with seeded weights
(corpus_arch.py), scikit-learn models trained on the data sets it ships, ONNX graphs written by hand.

``Case.atol`` 0 means bit-identical (the framework itself serves it); 1e-5 where a conversion ran.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).parent


@dataclass
class Case:
    id: str
    path: Path
    inputs: dict[str, np.ndarray]  # one request, batch axis included where the model batches
    expected: dict[str, np.ndarray]
    atol: float = 0.0
    deployment: dict[str, Any] = field(default_factory=dict)
    run: Callable[..., None] | None = None  # a flow of its own (the state carried across requests)
    what: str = ""


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _write(pkg: Path, code: str | None, manifest: dict[str, Any] | None) -> Path:
    pkg.mkdir(parents=True, exist_ok=True)
    if code is not None:
        (pkg / "snooze_model.py").write_text(textwrap.dedent(code))
    if manifest is not None:
        (pkg / "snooze_model.json").write_text(json.dumps(manifest))
    return pkg


# ------------------------------------------------------------------------------------------------
# torch architectures: exported to ONNX, and served as custom torch models


def torch_example(name: str) -> dict[str, np.ndarray]:
    from harness import corpus_arch

    out = {}
    for input_name, shape, dtype in corpus_arch.EXAMPLES[name]:
        out[input_name] = (
            _rng(1).standard_normal(shape).astype(dtype)
            if dtype == "float32"
            else _rng(1).integers(0, 100, shape).astype(dtype)
        )
    return out


def torch_reference(name: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The module's answer with one thread (what the served custom model runs with): bit-for-bit comparable."""
    import torch

    from harness import corpus_arch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            out = corpus_arch.build(name)(*[torch.from_numpy(v) for v in inputs.values()])
    finally:
        torch.set_num_threads(threads)
    return {corpus_arch.OUTPUTS[name]: out.numpy()}


def onnx_torch_case(root: Path, name: str) -> Case:
    from converters.torch_export import Exporter, export_module_to_onnx
    from harness import corpus_arch

    pkg = root / f"onnx-{name}"
    inputs = torch_example(name)
    export_module_to_onnx(
        corpus_arch.build(name),
        inputs,
        pkg / "model.onnx",
        [corpus_arch.OUTPUTS[name]],
        exporters=(Exporter.TORCHSCRIPT,),
    )
    return Case(f"onnx-{name}", pkg, inputs, torch_reference(name, inputs), atol=1e-5, what=f"{name} exported to ONNX")


TORCH_MODEL_PY = """
import numpy as np


class Model:
    def __init__(self, arch=""):
        self.arch = arch

    def load(self, model_dir, device):
        import torch

        import corpus_arch

        torch.set_num_threads(1)
        self.torch = torch
        self.module = corpus_arch.build(self.arch)
        self.input = corpus_arch.EXAMPLES[self.arch][0][0]
        self.output = corpus_arch.OUTPUTS[self.arch]

    def predict(self, inputs):
        with self.torch.no_grad():
            return {self.output: self.module(self.torch.from_numpy(inputs[self.input])).numpy()}
"""

_WIRE = {"float32": "FP32", "int64": "INT64", "float64": "FP64"}


def torch_custom_case(root: Path, name: str, worker: str) -> Case:
    from harness import corpus_arch

    pkg = root / f"torch-{name}-{worker}"
    [(input_name, shape, dtype)] = corpus_arch.EXAMPLES[name]
    inputs = torch_example(name)
    expected = torch_reference(name, inputs)
    [(output_name, out)] = expected.items()
    manifest = {
        "inputs": [{"name": input_name, "datatype": _WIRE[dtype], "dims": list(shape[1:])}],
        "outputs": [{"name": output_name, "datatype": "FP32", "dims": list(out.shape[1:])}],
        "params_schema": {"arch": {"type": "str"}},
        "params": {"arch": name},
        "env": {"OMP_NUM_THREADS": "1"},
    }
    if worker == "preforked":
        manifest["preload"] = ["torch"]
    _write(pkg, TORCH_MODEL_PY, manifest)
    shutil.copy(HERE / "corpus_arch.py", pkg / "corpus_arch.py")
    return Case(
        f"torch-{name}-{worker}",
        pkg,
        inputs,
        expected,
        deployment={"worker": worker},
        what=f"{name} as a custom torch model ({worker})",
    )


# ------------------------------------------------------------------------------------------------
# scikit-learn: trained at load on a bundled data set, and converted to ONNX


SKLEARN_PY = """
import numpy as np


def train(kind):
    from sklearn.datasets import load_breast_cancer, load_iris
    from sklearn.ensemble import GradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if kind == "pipeline":
        x, y = load_iris(return_X_y=True)
        return make_pipeline(StandardScaler(), LogisticRegression(max_iter=500)).fit(x, y)
    x, y = load_breast_cancer(return_X_y=True)
    return GradientBoostingClassifier(n_estimators=40, max_depth=3, random_state=0).fit(x, y)


class Model:
    def __init__(self, kind="pipeline"):
        self.kind = kind

    def load(self, model_dir, device):
        self.model = train(self.kind)

    def predict(self, inputs):
        return {"probabilities": self.model.predict_proba(inputs["features"])}
"""


def _sklearn_train(kind: str) -> Any:
    namespace: dict[str, Any] = {}
    exec(compile(textwrap.dedent(SKLEARN_PY), "snooze_model.py", "exec"), namespace)  # the package's own code
    return namespace["train"](kind)


def _sklearn_rows(kind: str) -> np.ndarray:
    from sklearn.datasets import load_breast_cancer, load_iris

    x = load_iris().data if kind == "pipeline" else load_breast_cancer().data
    return x[::25][:6].astype(np.float32).astype(np.float64)  # float32-exact: the ONNX copy reads float32


def sklearn_custom_case(root: Path, kind: str) -> Case:
    model = _sklearn_train(kind)
    rows = _sklearn_rows(kind)
    classes, features = len(model.classes_), rows.shape[1]
    pkg = _write(
        root / f"sklearn-{kind}",
        SKLEARN_PY,
        {
            "inputs": [{"name": "features", "datatype": "FP64", "dims": [features]}],
            "outputs": [{"name": "probabilities", "datatype": "FP64", "dims": [classes]}],
            "params_schema": {"kind": {"type": "str"}},
            "params": {"kind": kind},
            "env": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
        },
    )
    what = "iris: StandardScaler + LogisticRegression" if kind == "pipeline" else "breast cancer: gradient boosting"
    return Case(
        f"sklearn-{kind}",
        pkg,
        {"features": rows},
        {"probabilities": model.predict_proba(rows)},
        what=f"{what}, trained at load",
    )


def sklearn_onnx_case(root: Path, kind: str) -> Case:
    from skl2onnx import to_onnx

    model = _sklearn_train(kind)
    rows = _sklearn_rows(kind)
    options = {id(model): {"zipmap": False}}
    onx = to_onnx(model, rows[:1].astype(np.float32), options=options, target_opset={"": 17, "ai.onnx.ml": 3})
    pkg = root / f"onnx-sklearn-{kind}"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "model.onnx").write_bytes(onx.SerializeToString())
    expected = {"probabilities": model.predict_proba(rows), "label": model.predict(rows)}
    return Case(
        f"onnx-sklearn-{kind}",
        pkg,
        {"X": rows.astype(np.float32)},
        expected,
        atol=1e-5,
        what=f"sklearn {kind} converted by skl2onnx",
    )


# ------------------------------------------------------------------------------------------------
# Odd shapes: a scalar input, a state tensor, a variable-size detector, BYTES text


def scalar_onnx(path: Path, sr: str = "sr", x: str = "x", y: str = "y", n: str = "n") -> Path:
    """y = x * float(sr) with sr a rank-0 int64 (a voice-activity model's sample rate), n = sr (rank 0)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Cast", [sr], ["srf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [x, "srf"], [y]),
            helper.make_node("Identity", [sr], [n]),
        ],
        "scalar",
        [
            helper.make_tensor_value_info(sr, TensorProto.INT64, []),
            helper.make_tensor_value_info(x, TensorProto.FLOAT, ["?"]),
        ],
        [
            helper.make_tensor_value_info(y, TensorProto.FLOAT, ["?"]),
            helper.make_tensor_value_info(n, TensorProto.INT64, []),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path / "model.onnx"))
    return path


def scalar_case(root: Path) -> Case:
    """Also names as exporters write them (``/``, ``.``, ``:``), through the gateway on both protocols."""
    names = {"sr": "audio/sample_rate:0", "x": "input.x", "y": "out/y:0", "n": "meta.n"}
    pkg = scalar_onnx(root / "onnx-scalar", **names)
    x = np.array([0.25, -3.0, 7.5], np.float32)
    return Case(
        "onnx-scalar",
        pkg,
        {names["sr"]: np.array([16000], np.int64), names["x"]: x},
        {names["y"]: x * np.float32(16000), names["n"]: np.array([16000], np.int64)},
        what="rank-0 int64 input, tensor names with / . :",
    )


def _export(
    module: Any, args: tuple, path: Path, names: list[str], outputs: list[str], axes: dict[str, dict[int, str]]
) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(
            module,
            args,
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=names,
            output_names=outputs,
            dynamic_axes=axes,
        )


def stateful_case(root: Path) -> Case:
    """x [1, batch, 16] and the GRU state h [2, batch, 128]: the batch axis is not the first."""
    import torch

    from harness import corpus_arch

    module = corpus_arch.build("stateful-gru")
    pkg = root / "onnx-stateful-gru"
    _export(
        module,
        (torch.zeros(1, 1, 16), torch.zeros(2, 1, 128)),
        pkg / "model.onnx",
        ["x", "h"],
        ["y", "h_out"],
        {"x": {1: "batch"}, "h": {1: "batch"}, "y": {1: "batch"}, "h_out": {1: "batch"}},
    )
    steps = _rng(3).standard_normal((20, 1, 1, 16)).astype(np.float32)
    h = torch.zeros(2, 1, 128)
    with torch.no_grad():
        for x in steps:
            y, h = module(torch.from_numpy(x), h)
    return Case(
        "onnx-stateful-gru",
        pkg,
        {"steps": steps},
        {"y": y.numpy(), "h_out": h.numpy()},
        atol=1e-5,
        what="state [2, batch, 128] carried by the client over 20 requests",
    )


def detector_case(root: Path) -> Case:
    """Images of any size that is a multiple of 16; the generated warm-up's [1,3,1,1] fails (the head's concat)."""
    import torch

    from harness import corpus_arch

    module = corpus_arch.build("detector")
    pkg = root / "onnx-detector"
    _export(
        module,
        (torch.zeros(2, 3, 64, 64),),
        pkg / "model.onnx",
        ["images"],
        ["boxes"],
        {"images": {0: "batch", 2: "height", 3: "width"}, "boxes": {0: "batch", 1: "cells"}},
    )
    images = _rng(4).standard_normal((1, 3, 96, 64)).astype(np.float32)
    with torch.no_grad():
        boxes = module(torch.from_numpy(images)).numpy()
    return Case(
        "onnx-detector",
        pkg,
        {"images": images},
        {"boxes": boxes},
        atol=1e-5,
        what="two-scale detector, variable image size",
    )


TEXT_PY = """
import zlib

import numpy as np

BUCKETS = 16


def features(texts):
    out = np.zeros((len(texts), BUCKETS), np.float32)
    for row, text in enumerate(texts):
        for word in text.decode("utf-8").lower().split():
            out[row, zlib.crc32(word.encode()) % BUCKETS] += 1.0
    return out


class Model:
    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        texts = inputs["text"].reshape(-1)
        return {"counts": features(texts)}
"""


def text_case(root: Path) -> Case:
    pkg = _write(
        root / "text-bytes",
        TEXT_PY,
        {
            "inputs": [{"name": "text", "datatype": "BYTES", "dims": [1]}],
            "outputs": [{"name": "counts", "datatype": "FP32", "dims": [16]}],
        },
    )
    namespace: dict[str, Any] = {}
    exec(compile(textwrap.dedent(TEXT_PY), "snooze_model.py", "exec"), namespace)
    texts = np.array([["the quick brown fox"], ["Snooze ML serves models"], ["ünïcode wörds too"]], dtype=object)
    texts = np.vectorize(lambda s: s.encode(), otypes=[object])(texts)
    return Case(
        "text-bytes",
        pkg,
        {"text": texts},
        {"counts": namespace["features"](texts.reshape(-1))},
        what="BYTES text, hashed bag of words",
    )


# ------------------------------------------------------------------------------------------------
# ONNX models that read text (tensor(string) inputs): Triton hands BYTES over as bytes, onnxruntime reads str


def _utf8(array: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda s: s.encode("utf-8"), otypes=[object])(array)


def _onnxruntime_answer(onx: Any, text_inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """onnxruntime in this process, given the text itself; string outputs as the UTF-8 bytes BYTES carries."""
    import onnxruntime as ort

    session = ort.InferenceSession(onx.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    answers = session.run(names, text_inputs)
    return {name: _utf8(a) if a.dtype == object else a for name, a in zip(names, answers, strict=True)}


def _save_onnx(pkg: Path, onx: Any) -> Path:
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "model.onnx").write_bytes(onx.SerializeToString())
    return pkg


CITIES = ["zürich", "oslo", "são paulo", "kyiv", "montréal", "lagos"]
WARM_CITIES = {"são paulo", "lagos"}


def sklearn_cities_case(root: Path) -> Case:
    """OneHotEncoder on a city name, then LogisticRegression, converted by skl2onnx: the string categories are
    matched inside the graph, so a city read as "b'oslo'" is an unknown one (every city answered alike)."""
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import StringTensorType
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder

    rng = _rng(5)
    x = rng.choice(np.array(CITIES, dtype=object), 200).reshape(-1, 1)
    noise = rng.random(len(x)) < 0.1
    y = np.array([(c in WARM_CITIES) != flip for c, flip in zip(x[:, 0], noise, strict=True)], np.int64)
    model = make_pipeline(OneHotEncoder(handle_unknown="ignore"), LogisticRegression()).fit(x, y)
    onx = to_onnx(
        model,
        initial_types=[("city", StringTensorType([None, 1]))],
        options={id(model.steps[-1][1]): {"zipmap": False}},
        target_opset={"": 17, "ai.onnx.ml": 3},
    )
    cities = np.array([["lagos"], ["oslo"], ["são paulo"], ["kyiv"], ["atlantis"]], dtype=object)
    expected = _onnxruntime_answer(onx, {"city": cities})
    assert expected["label"].tolist() == model.predict(cities).tolist() == [1, 0, 1, 0, 0]  # a case that can fail
    pkg = _save_onnx(root / "onnx-text-sklearn-cities", onx)
    return Case(
        "onnx-text-sklearn-cities",
        pkg,
        {"city": _utf8(cities)},
        expected,
        what="skl2onnx OneHotEncoder(city) + LogisticRegression, string input",
    )


def string_normalizer_case(root: Path) -> Case:
    """StringNormalizer: stopwords dropped ignoring case, the rest upper-cased. onnxruntime's default locale is
    en_US.UTF-8, which a machine may lack (then the session cannot be built): the model names C.UTF-8."""
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node(
        "StringNormalizer",
        ["words"],
        ["normalized"],
        case_change_action="UPPER",
        is_case_sensitive=0,
        stopwords=["the", "monday"],
        locale="C.UTF-8",
    )
    graph = helper.make_graph(
        [node],
        "normalizer",
        [helper.make_tensor_value_info("words", TensorProto.STRING, [1, "n"])],
        [helper.make_tensor_value_info("normalized", TensorProto.STRING, [1, "m"])],
    )
    onx = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onx.ir_version = 8
    onnx.checker.check_model(onx)
    words = np.array([["The", "quick", "MONDAY", "fox", "Straße", "the"]], dtype=object)
    expected = _onnxruntime_answer(onx, {"words": words})
    assert expected["normalized"].tolist() == [[b"QUICK", b"FOX", "STRAßE".encode()]]  # a case that can fail
    pkg = _save_onnx(root / "onnx-text-normalizer", onx)
    return Case(
        "onnx-text-normalizer",
        pkg,
        {"words": _utf8(words)},
        expected,
        what="StringNormalizer: stopwords, case-insensitive, upper-case (locale C.UTF-8)",
    )


def label_encoder_case(root: Path) -> Case:
    """ai.onnx.ml LabelEncoder from words to ids (-1 for a word it does not know), three words a row, batched."""
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node(
        "LabelEncoder",
        ["words"],
        ["ids"],
        domain="ai.onnx.ml",
        keys_strings=CITIES,
        values_int64s=list(range(len(CITIES))),
        default_int64=-1,
    )
    graph = helper.make_graph(
        [node],
        "labels",
        [helper.make_tensor_value_info("words", TensorProto.STRING, ["batch", 3])],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 3])],
    )
    onx = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 2)])
    onx.ir_version = 8
    onnx.checker.check_model(onx)
    words = np.array([["lagos", "montréal", "zürich"], ["atlantis", "oslo", "são paulo"]], dtype=object)
    expected = _onnxruntime_answer(onx, {"words": words})
    assert expected["ids"].tolist() == [[5, 4, 0], [-1, 1, 2]]  # a case that can fail
    pkg = _save_onnx(root / "onnx-text-label-encoder", onx)
    return Case(
        "onnx-text-label-encoder",
        pkg,
        {"words": _utf8(words)},
        expected,
        what="ai.onnx.ml LabelEncoder, strings to int64",
    )
