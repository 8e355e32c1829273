"""`snoozectl triton`: the embedded tritonserver alone, as the compose `triton` service runs the official image.

Explicit model control, no auto-complete, the repository API restricted when an admin key is set, the
gateway's request-id header forwarded to the python backend, and the request journal folder in the
environment of its stubs. With `snoozectl serve --triton-url ...` beside it, one machine runs the
two-process topology of docker compose and Kubernetes (see docs/deploy.md).
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from controlplane.cli.output import fail, out_console
from controlplane.errors import SnoozeError


def register(app: typer.Typer) -> None:
    @app.command()
    def triton(
        model_repository: Annotated[Path, typer.Option(help="The model repository Triton serves (created if missing)")],
        work_dir: Annotated[Path, typer.Option(help="Logs, backend folder, request journal")] = Path(".snooze-triton"),
        host: Annotated[str, typer.Option(help="Address Triton listens on")] = "127.0.0.1",
        http_port: Annotated[int, typer.Option(help="HTTP port (0 = a free port)")] = 8100,
        grpc_port: Annotated[int, typer.Option(help="gRPC port (0 = a free port)")] = 8101,
        metrics_port: Annotated[int, typer.Option(help="Metrics port (0 = a free port)")] = 8102,
        journal_dir: Annotated[
            Path | None, typer.Option(help="Request journal folder [SNOOZE_JOURNAL_DIR; <work-dir>/journal]")
        ] = None,
        exit_timeout_secs: Annotated[
            int, typer.Option(help="On stop, how long Triton waits for in-flight requests and unloads")
        ] = 30,
        as_json: Annotated[bool, typer.Option("--json", help="Print the URLs as one JSON line once live")] = False,
    ) -> None:
        """Run tritonserver alone (explicit model control) until Ctrl-C; serve connects with --triton-url.

        The repository API needs the header `snooze-admin: $SNOOZE_TRITON_ADMIN_KEY` when that variable is set.
        """
        from controlplane.child_processes import kill_group
        from controlplane.settings import Settings
        from controlplane.triton.launcher import EmbeddedTriton, doze_admit_bound

        try:
            settings = Settings()
            key = settings.triton_admin_key.get_secret_value() if settings.triton_admin_key else None
            model_repository.mkdir(parents=True, exist_ok=True)
            server = EmbeddedTriton(
                model_repository,
                work_dir,
                host=host,
                http_port=http_port or None,
                grpc_port=grpc_port or None,
                metrics_port=metrics_port or None,
                exit_timeout_secs=exit_timeout_secs,
                journal_dir=journal_dir or settings.journal_dir,
                admin_header=settings.triton_admin_header,
                admin_key=key,
                bls_wake_timeout_secs=settings.bls_wake_timeout_secs,
                doze_admit_timeout_secs=doze_admit_bound(settings.wake_queue_timeout_secs),
            )
            stop = threading.Event()

            def on_signal(*_: object) -> None:
                if stop.is_set() and server.pid:  # a second Ctrl-C, or SIGTERM during the stop: no graceful wait
                    kill_group(server.pid)  # tritonserver, its stubs and preforked parents and workers
                stop.set()

            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, on_signal)
            server.start()
        except SnoozeError as exc:
            raise fail(exc, as_json) from None
        urls = {
            "http_url": server.http_url,
            "grpc_url": server.grpc_url,
            "metrics_url": server.metrics_url,
            "pid": server.pid,
            "journal_dir": str(server.journal_dir),
            "log": str(server.log_file),
        }
        if as_json:
            print(json.dumps(urls), flush=True)
        else:
            out_console.print(
                f"tritonserver (pid {server.pid}) live: HTTP {server.http_url}  gRPC {server.grpc_url}  metrics "
                f"{server.metrics_url}\nlog {server.log_file}; request journal {server.journal_dir}\n"
                f"connect: snoozectl serve --triton-url {server.http_url} --triton-grpc-url {server.grpc_url} "
                f"--triton-metrics-url {server.metrics_url} --model-repository {model_repository.resolve()}",
                highlight=False,
            )
        try:
            while not stop.wait(0.5):
                if not server.is_running():
                    out_console.print(f"tritonserver exited; last lines of its log:\n{server.log_tail()}")
                    raise typer.Exit(1)
        finally:
            server.stop()
