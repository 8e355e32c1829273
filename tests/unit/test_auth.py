"""API keys: where they are read from, scopes, constant-time comparison, counted refusals."""

from __future__ import annotations

import pytest

from controlplane import auth
from controlplane.auth import Scope, check_scope, key_scopes, presented_key
from controlplane.errors import AuthError, ForbiddenError
from controlplane.metrics import SnoozeMetrics
from controlplane.settings import Settings


@pytest.fixture
def settings() -> Settings:
    return Settings(admin_keys=["adm-1", "adm-2"], api_keys=["inf-1", "inf-2", "inf-3"])


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ({"X-API-Key": "k"}, "k"),
        ({"x-api-key": " k "}, "k"),
        ({"Authorization": "Bearer k"}, "k"),
        ({"authorization": "bearer   k"}, "k"),
        ({"X-API-Key": "a", "Authorization": "Bearer b"}, "a"),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, None),
        ({"Authorization": "Bearer "}, None),
        ({"X-API-Key": ""}, None),
        ({}, None),
    ],
)
def test_presented_key_from_headers(headers: dict[str, str], key: str | None) -> None:
    assert presented_key(headers) == key


def test_presented_key_from_grpc_metadata_pairs() -> None:
    assert presented_key([("user-agent", "grpc"), ("authorization", "Bearer k")]) == "k"
    assert presented_key((("x-api-key", "k2"),)) == "k2"


def test_admin_implies_inference(settings: Settings) -> None:
    assert key_scopes(settings, "adm-2") == {Scope.ADMIN, Scope.INFERENCE}
    assert key_scopes(settings, "inf-3") == {Scope.INFERENCE}
    assert key_scopes(settings, "adm-") == set()
    assert key_scopes(settings, "") == set()


def test_every_key_is_compared_on_every_check(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[bytes] = []
    real = auth.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    for key in ("adm-1", "inf-1", "nobody"):
        compared.clear()
        key_scopes(settings, key)
        assert sorted(compared) == [b"adm-1", b"adm-2", b"inf-1", b"inf-2", b"inf-3"], key


def test_check_scope_accepts_matching_keys(settings: Settings) -> None:
    check_scope(settings, {"X-API-Key": "adm-1"}, Scope.ADMIN)
    check_scope(settings, {"X-API-Key": "adm-1"}, "inference")
    check_scope(settings, {"Authorization": "Bearer inf-2"}, Scope.INFERENCE)


@pytest.mark.parametrize(
    ("headers", "scope", "error", "message", "reason"),
    [
        ({}, Scope.ADMIN, AuthError, "missing API key", "missing"),
        ({"X-API-Key": "wrong"}, Scope.INFERENCE, AuthError, "invalid API key", "invalid"),
        ({"X-API-Key": "inf-1"}, Scope.ADMIN, ForbiddenError, "does not have the 'admin' scope", "scope"),
    ],
)
def test_refusals_are_named_and_counted(
    settings: Settings, headers: dict, scope: Scope, error: type, message: str, reason: str
) -> None:
    metrics = SnoozeMetrics()
    with pytest.raises(error) as info:
        check_scope(settings, headers, scope, metrics=metrics, surface="activator")
    assert message in info.value.message
    assert info.value.status_code == (403 if error is ForbiddenError else 401)
    count = metrics.registry.get_sample_value("snooze_auth_failures_total", {"surface": "activator", "reason": reason})
    assert count == 1.0


def test_auth_on_without_keys_refuses_everything_with_a_fix() -> None:
    with pytest.raises(AuthError) as info:
        check_scope(Settings(), {"X-API-Key": "anything"}, Scope.INFERENCE)
    assert "no API keys configured" in info.value.message
    assert "SNOOZE_AUTH=off" in info.value.hint


def test_auth_off_accepts_everything() -> None:
    check_scope(Settings(auth="off"), {}, Scope.ADMIN)
