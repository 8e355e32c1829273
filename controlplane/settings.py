"""The one settings class. Every field can be set as an environment variable ``SNOOZE_<FIELD>``;
flags are parsed only in the CLI, which builds a Settings and hands it down."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from controlplane.modes import AuthMode, EvictionMode, TargetName


class Settings(BaseSettings):
    # An empty variable is an unset one: docker-compose.yml passes optional settings from .env as
    # `${SNOOZE_X:-}`, which is "" when .env leaves them out.
    model_config = SettingsConfigDict(env_prefix="SNOOZE_", extra="ignore", env_ignore_empty=True)

    # --- where things live
    work_dir: Path = Field(
        Path(".snooze"), validate_default=True, description="Runtime folder: repository, logs, Envoy config"
    )
    model_repository: Path | None = Field(
        None, description="Generated Triton model repository (default: <work_dir>/model_repository)"
    )
    target: TargetName = Field(TargetName.EMBEDDED, description="Which backends Triton has")

    # --- Triton
    triton_url: str | None = Field(
        None, description="HTTP URL of an external Triton; unset = start the embedded tritonserver"
    )
    triton_grpc_url: str | None = Field(None, description="gRPC host:port of an external Triton")
    triton_metrics_url: str | None = Field(
        None, description="Metrics URL of an external Triton (pending requests drive idle unload and autoscaling)"
    )
    journal_dir: Path | None = Field(
        None,
        description="Folder where Triton's python stubs journal the requests they run (shared with Triton; "
        "default: <work_dir>/journal for the embedded Triton, else what the seen tritonserver was started with)",
    )
    observe_triton_processes: bool = Field(
        True,
        description="Look for an external Triton's processes (a shared PID namespace); false = treat it as "
        "remote: memory declared, crashes found by errors only",
    )
    triton_wait_secs: float = Field(
        60.0, description="How long serve waits at start for an external Triton to answer (it may start later)"
    )
    triton_http_port: int = Field(0, description="Embedded Triton HTTP port (0 = a free port)")
    triton_grpc_port: int = Field(0, description="Embedded Triton gRPC port (0 = a free port)")
    triton_metrics_port: int = Field(0, description="Embedded Triton metrics port (0 = a free port)")
    triton_admin_header: str = Field(
        "snooze-admin", description="Header of Triton's restricted model-repository API (compose/Kubernetes)"
    )
    triton_admin_key: SecretStr | None = Field(
        None, description="Its value; unset = Triton's repository API is not restricted (embedded)"
    )
    restart_triton: bool = Field(True, description="Restart the embedded tritonserver when it dies")

    # --- gateway (Envoy) and activator
    host: str = Field("127.0.0.1", description="Address the gateway and API listen on")
    http_port: int = Field(8000, description="Gateway KServe v2 HTTP port (clients connect here)")
    grpc_port: int = Field(8001, description="Gateway KServe v2 gRPC port (clients connect here)")
    api_port: int = Field(8080, description="Control API port")
    envoy_admin_port: int = Field(0, description="Envoy admin/stats port on loopback (0 = a free port)")
    activator_http_port: int = Field(0, description="Activator HTTP port on loopback (0 = a free port)")
    activator_grpc_port: int = Field(0, description="Activator gRPC port on loopback (0 = a free port)")
    wake_buffer_bytes: int = Field(
        8 * 1024 * 1024,
        description="Largest HTTP request body Envoy keeps to re-send to the activator when Triton answers "
        "'not found' (the retry wake path); a larger request, and every stream, is woken before its body moves "
        "on instead (the wake filter), so any size Triton accepts wakes a sleeping model. gRPC's retry keeps "
        "any message Triton accepts (gRPC carries no content-length a route could match)",
    )
    gateway: bool = Field(True, description="Start Envoy; off = clients talk to Triton directly")

    # --- lifecycle
    sweep_interval_secs: float = Field(1.0, description="How often idle models and Triton's health are checked")
    watch_interval_secs: float = Field(0.2, description="How often the model processes of loaded models are checked")
    store_poll_secs: float = Field(
        1.0, description="How often the repository is checked for models another node republished or deleted"
    )
    wake_timeout_secs: float | None = Field(
        None, description="Longest a request waits for a cold start (default: the model's load_timeout_secs)"
    )
    bls_wake_timeout_secs: float = Field(
        60.0,
        gt=0,
        description="Longest a BLS call into a sleeping model waits for it to wake, when the call's "
        "InferenceRequest sets no timeout of its own (Triton's python stubs read it from their environment)",
    )
    max_concurrent_loads: int = Field(
        4,
        ge=1,
        description="Loads running at once where no GPU is present (each reserves its memory in the budget first); "
        "on a machine with a GPU loads run one at a time (their GPU memory is measured as what each load added)",
    )
    publish_helper_from: int = Field(
        300,
        ge=0,
        description="`serve --models` with at least this many packages to write starts a second process that "
        "renders and writes model folders beside the control plane, which commits each (0: never)",
    )
    fast_unload: bool = Field(
        True,
        description="Where Triton's processes can be seen, end an unloaded python model's processes as soon as "
        "Triton has taken it out of service and none of them runs a request (its memory is free in "
        "milliseconds instead of after the python backend's 1 s health probe); False: wait for Triton's unload",
    )
    unload_finalize_secs: float = Field(
        10.0,
        gt=0,
        description="A model that declares unload() keeps Triton's full unload (its unload() runs): how long, past "
        "the python backend's 1 s health probe, its processes may take to exit before they are ended (Triton "
        "waits for a finalizing stub without a limit)",
    )
    memory_budget_mb: float | None = Field(
        None,
        description="Memory for the Triton tree (proportional: shared pages split among the processes mapping "
        "them); unset = the limit of Triton's memory cgroup less SNOOZE_MEMORY_HEADROOM_MB where it can be read, "
        "else no limit",
    )
    memory_headroom_mb: float | None = Field(
        None,
        ge=0,
        description="What the budget leaves free below Triton's cgroup memory limit (its default budget, and the "
        "ceiling each sweep checks the cgroup's usage against); unset = 10% of the limit",
    )
    eviction_policy: EvictionMode = Field(
        EvictionMode.GDSF,
        description="Which idle model leaves memory first when a load needs room: 'gdsf' (GreedyDual-Size-"
        "Frequency: weighs each model's request frequency, measured load time and memory, so a hot set stays "
        "loaded through a burst of one-off requests) or 'lru' (least recently used)",
    )
    wake_queue_timeout_secs: float = Field(
        10.0,
        gt=0,
        description="Longest a request waits for its model's load to START (for a load slot, or for memory "
        "that loads and requests in flight hold) before it is answered 503 with Retry-After; the load itself "
        "then has SNOOZE_WAKE_TIMEOUT_SECS (default: the model's load_timeout_secs)",
    )
    gpu_memory_budget_mb: float | None = Field(
        None,
        gt=0,
        description="GPU memory for loaded models, per GPU (the same budget applies to each GPU on its own); "
        "unset = no limit",
    )
    autoscale: bool = Field(True, description="Add instances when a model's queue stays long")
    autoscale_queue_threshold: float = Field(4.0, description="Pending requests per instance that triggers scale-up")
    autoscale_window_secs: float = Field(5.0, description="How long the queue must stay above the threshold")
    doze_after_secs: float = Field(
        30.0,
        ge=0,
        description='Preforked custom models (worker = "preforked"): after this long without a request the model '
        "dozes: its workers end (their memory back to the OS) while Triton keeps it loaded, and its next request "
        "forks a fresh worker (tens of ms). Only where it is below the model's idle_timeout_secs, which still "
        "unloads it; 0: never doze",
    )
    # the defaults are controlplane.keepalive.MIN_SAMPLES / MIN_UNLOADED_SECS (not imported: it loads numpy)
    keep_alive_min_samples: int = Field(
        10,
        ge=1,
        description='Models with keep_alive = "adaptive": idle times seen before the learned windows replace '
        "idle_timeout_secs",
    )
    keep_alive_min_unloaded_secs: float = Field(
        60.0,
        ge=0,
        description='Models with keep_alive = "adaptive": unload between requests and pre-warm only when the model '
        "then stays out of memory at least this long (lower it for callers whose period is seconds)",
    )

    # --- control API
    allow_local_paths: bool = Field(
        True, description="Let publish name a folder on the server's filesystem (off for shared servers)"
    )
    max_upload_mb: float = Field(2048, description="Largest package upload")
    shutdown_grace_secs: float = Field(30, description="How long in-flight requests may finish on shutdown")
    triton_exit_timeout_secs: int = Field(
        10,
        ge=0,
        description="The embedded tritonserver's --exit-timeout-secs: how long it may finish requests and unload "
        "models when it stops (after a stub died, Triton keeps that model live and waits all of it)",
    )

    # --- auth: keys compared in constant time; auth off only when said so
    auth: AuthMode = Field(AuthMode.ON, description="'off' disables API keys (local use only)")
    api_keys: list[SecretStr] = Field(default_factory=list, description="Keys with the inference scope")
    admin_keys: list[SecretStr] = Field(default_factory=list, description="Keys with the admin scope")

    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("work_dir", "model_repository", "journal_dir")
    @classmethod
    def _absolute(cls, path: Path | None) -> Path | None:
        # Resolved once here: Envoy, Triton and the stubs each run with a cwd of their own, so a relative
        # path (`--work-dir .snooze`, as `make serve` passes it) would name another folder in each.
        return None if path is None else path.expanduser().resolve()

    def triton_headers(self) -> dict[str, str] | None:
        if self.triton_admin_key is None:
            return None
        return {self.triton_admin_header: self.triton_admin_key.get_secret_value()}

    @property
    def repository(self) -> Path:
        return self.model_repository or self.work_dir / "model_repository"
