#!/usr/bin/env bash
# Make sure a Docker engine answers on this machine; start one if none does.
#
#   deploy/docker/engine.sh            # exit 0 once `docker info` answers
#
# For machines with no engine running (CI sandboxes, this project's development machines): as root,
# it installs Debian's docker.io and debootstrap with apt when dockerd is missing, then starts
#   dockerd --bridge=none --iptables=false --ip-masq=false
# No container gets an address on a bridge: every container of the compose test uses the host
# network, no network, or another container's namespace.
#
# Exit codes (distinct, so that CI can say plainly why the compose test did not run):
#   0  an engine answers
#   10 no engine answers and this is not root (cannot start one)
#   11 no dockerd and it cannot be installed (no apt-get, or apt-get failed)
#   12 dockerd was started but did not answer within ENGINE_WAIT_SECS (default 60); see its log
#   13 no docker client on PATH
set -uo pipefail

LOG=${DOCKERD_LOG:-/var/log/snooze-dockerd.log}
WAIT=${ENGINE_WAIT_SECS:-60}

say() { echo "engine: $*" >&2; }

# dockerd lives in /usr/sbin (Debian's docker.io): look there too when PATH lacks it (root through
# `su` or a CI step keeps a user's PATH).
SBIN_DIRS=${ENGINE_SBIN_DIRS-/usr/local/sbin:/usr/sbin:/sbin}
[ -n "$SBIN_DIRS" ] && PATH=$PATH:$SBIN_DIRS

if ! command -v docker >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "no docker client: installing Debian's docker.io"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >&2 || { say "apt-get install docker.io failed"; exit 11; }
  else
    say "no docker client on PATH; install Docker (or Debian's docker.io) first"; exit 13
  fi
fi

if docker info >/dev/null 2>&1; then
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  say "no Docker engine answers and this is not root: start one (sudo dockerd ...) or run as root"
  exit 10
fi

if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    say "no dockerd/debootstrap and no apt-get to install them (Debian's docker.io, debootstrap)"
    exit 11
  fi
  say "installing Debian's docker.io and debootstrap"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q docker.io debootstrap >&2 \
    || { apt-get update -q >&2 && apt-get install -y -q docker.io debootstrap >&2; } \
    || { say "apt-get install docker.io debootstrap failed (after apt-get update)"; exit 11; }
  command -v dockerd >/dev/null 2>&1 || { say "docker.io installed but no dockerd on PATH"; exit 11; }
fi

say "starting dockerd --bridge=none --iptables=false --ip-masq=false (log: $LOG)"
# setsid: the daemon outlives the shell (and the CI step) that started it.
setsid dockerd --bridge=none --iptables=false --ip-masq=false >>"$LOG" 2>&1 < /dev/null &
for _ in $(seq 1 $((WAIT * 5))); do
  if docker info >/dev/null 2>&1; then
    say "engine up ($(docker version --format '{{.Server.Version}}' 2>/dev/null))"
    exit 0
  fi
  sleep 0.2
done
say "dockerd did not answer within ${WAIT}s; last lines of $LOG:"
tail -n 20 "$LOG" >&2
exit 12
