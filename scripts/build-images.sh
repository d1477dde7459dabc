#!/usr/bin/env bash
# Build every container image of the project on a machine without an image registry (`make images`):
#
#   reinforce-base:<release>    Debian from debootstrap --variant=minbase (the machine's own release and mirror),
#                               with python3, python3-venv, libpython3.X, ca-certificates, curl and redis-server
#   reinforce-runtime:0.1.0     services/reinforce/core/Dockerfile FROM that base: venv, torch (CPU), the project
#   reinforce-reward:0.1.0, reinforce-generator:0.1.0, reinforce-trainer:0.1.0, reinforce-critic:0.1.0,
#   reinforce-environment:0.1.0, reinforce-operator:0.1.0
#                               services/reinforce/<name>/Dockerfile FROM the runtime (CPU variants)
#   reinforce-redis:0.1.0       Debian's redis-server, standing in for redis:7.0 (which cannot be pulled here)
#   reinforce-prometheus:0.1.0  Debian's prometheus package on that base (apt from the same mirror), for
#                               docker-compose.yml's profile `monitoring`
#
# Usage: scripts/build-images.sh [build]     build (or bring up to date) every image
#        scripts/build-images.sh stop-dockerd stop the dockerd this script started, if any
#
# Docker daemon: $DOCKER_HOST if set (another dockerd, e.g. the single-node cluster's), else /var/run/docker.sock.
# When neither answers, the script starts Debian's dockerd on /var/run/docker.sock (installing docker.io if needed)
# with --iptables=false --ip-masq=false --bridge=none and cgroupfs (this machine cannot set up the default bridge;
# user-defined networks, such as docker-compose's, still work) and leaves it running: its pid is in
# $CACHE/dockerd/dockerd.pid, its log in $CACHE/dockerd/dockerd.log; `stop-dockerd` stops it.
#
# Python packages come from a wheelhouse made on the host with the host's pip (torch pinned first, then the rest of
# pyproject.toml's dependencies) and served to the build over HTTP on 127.0.0.1 (docker build --network host).
# Cached in $CACHE (default ~/.cache/reinforce-images): the root filesystem tarball and the wheelhouse are made once;
# a second build reuses them and docker's layer cache. Needs root for debootstrap and dockerd.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${REINFORCE_IMAGES_CACHE:-$HOME/.cache/reinforce-images}"
# The release's own python3, the images' Python: the wheelhouse must be resolved for its exact version (markers such
# as python_full_version < "3.11.3" pick dependencies).
PYTHON=/usr/bin/python3
VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml")"
SERVICES=(reward generator trainer critic environment operator)
DOCKER="${DOCKER:-$(command -v docker || echo /usr/bin/docker)}"

# Log lines go to the script's stderr even from commands whose output goes to a log file. Background processes are
# started with 3>&-: a daemon holding a copy of the caller's stderr keeps the caller waiting for end of output.
exec 3>&2
log() { printf '[build-images %4ds] %s\n' "$SECONDS" "$*" >&3; }
die() { log "error: $*"; exit 1; }
timed() {  # timed WHAT COMMAND...: run it, then log how long it took
    local what="$1" start="$SECONDS"
    shift
    "$@" || return
    log "$what: $((SECONDS - start))s"
}

# --- the Docker daemon -------------------------------------------------------------------------------------------
daemon_answers() { "$DOCKER" version >/dev/null 2>&1; }

ensure_docker() {
    if [ -n "${DOCKER_HOST:-}" ]; then
        daemon_answers || die "DOCKER_HOST=$DOCKER_HOST does not answer"
        log "docker daemon: $DOCKER_HOST"
        return
    fi
    if daemon_answers; then
        log "docker daemon: /var/run/docker.sock"
        return
    fi
    [ "$(id -u)" = 0 ] || die "no docker daemon answers and starting one needs root"
    command -v dockerd >/dev/null || { log "installing Debian's docker.io"; apt-get install -y -qq docker.io >/dev/null; }
    mkdir -p "$CACHE/dockerd"
    log "starting dockerd on /var/run/docker.sock (log $CACHE/dockerd/dockerd.log)"
    setsid dockerd --iptables=false --ip-masq=false --bridge=none --exec-opt native.cgroupdriver=cgroupfs \
        >"$CACHE/dockerd/dockerd.log" 2>&1 </dev/null 3>&- &
    echo $! >"$CACHE/dockerd/dockerd.pid"
    for _ in $(seq 60); do
        daemon_answers && { log "dockerd ready, pid $(cat "$CACHE/dockerd/dockerd.pid")"; return; }
        kill -0 "$(cat "$CACHE/dockerd/dockerd.pid")" 2>/dev/null || die "dockerd exited; see $CACHE/dockerd/dockerd.log"
        sleep 1
    done
    die "dockerd not ready after 60s; see $CACHE/dockerd/dockerd.log"
}

stop_dockerd() {
    local pidfile="$CACHE/dockerd/dockerd.pid" pid
    [ -f "$pidfile" ] || { log "no dockerd started by this script"; return; }
    pid="$(cat "$pidfile")"
    if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = dockerd ]; then
        kill "$pid"
        while kill -0 "$pid" 2>/dev/null; do sleep 0.5; done
        log "stopped dockerd $pid"
    fi
    rm -f "$pidfile"
}

# --- the base image: Debian from debootstrap ----------------------------------------------------------------------
RELEASE="$(. /etc/os-release && echo "$VERSION_CODENAME")"
BASE_IMAGE="reinforce-base:$RELEASE"
# libpython3.X: Triton's Python backend links the system libpython (X: the release's python3, i.e. this machine's).
BASE_PACKAGES="python3,python3-venv,libpython3.$(/usr/bin/python3 -c 'import sys; print(sys.version_info[1])'),ca-certificates,curl,redis-server,libjemalloc2"

debian_mirror() {  # the first mirror of the machine's apt sources (deb822 or one-line) that serves $RELEASE
    cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
        awk -v release="$RELEASE" '
            function found() { if (uri && suite && !done) { print uri; done = 1; exit } }
            /^[[:space:]]*$/ { found(); uri = ""; suite = 0 }
            /^URIs:/ { uri = $2 }
            /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == release) suite = 1 }
            $1 == "deb" && $3 == release { uri = $2; suite = 1; found() }
            END { found() }' || true
}

build_base() {
    local tarball="$CACHE/rootfs-$RELEASE-$(echo "$BASE_PACKAGES" | sha256sum | cut -c1-12).tar"
    if [ ! -f "$tarball" ]; then
        [ "$(id -u)" = 0 ] || die "debootstrap needs root"
        command -v debootstrap >/dev/null || { log "installing debootstrap"; apt-get install -y -qq debootstrap >/dev/null; }
        local mirror rootfs
        mirror="$(debian_mirror)"
        [ -n "$mirror" ] || die "no apt source for $RELEASE in /etc/apt"
        rootfs="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
        log "debootstrap --variant=minbase $RELEASE from $mirror (+ $BASE_PACKAGES)"
        timed "debootstrap" debootstrap --variant=minbase --include="$BASE_PACKAGES" "$RELEASE" "$rootfs" "$mirror" \
            >"$CACHE/debootstrap.log" 2>&1 || die "debootstrap failed; see $CACHE/debootstrap.log"
        rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
        tar -C "$rootfs" -cf "$tarball.partial" . && mv "$tarball.partial" "$tarball"
        rm -rf "$rootfs"
    fi
    if [ "$("$DOCKER" image inspect -f '{{index .Config.Labels "rootfs"}}' "$BASE_IMAGE" 2>/dev/null)" != "${tarball##*/}" ]; then
        timed "docker import $BASE_IMAGE" "$DOCKER" import -c "LABEL rootfs=${tarball##*/}" -c 'CMD ["bash"]' \
            "$tarball" "$BASE_IMAGE" >/dev/null
    fi
}

# --- the wheelhouse --------------------------------------------------------------------------------------------
WHEELS="$CACHE/wheels"

build_wheelhouse() {
    local stamp="$WHEELS/.requirements" wanted requirements
    requirements="$("$PYTHON" "$ROOT/scripts/requirements.py" torch; "$PYTHON" "$ROOT/scripts/requirements.py" rest)"
    wanted="$("$PYTHON" -VV; echo "$requirements")"
    [ "$(cat "$stamp" 2>/dev/null)" = "$wanted" ] && return
    "$PYTHON" -m pip --version >/dev/null 2>&1 || { log "installing python3-pip"; apt-get install -y -qq python3-pip >/dev/null; }
    mkdir -p "$WHEELS" "$CACHE/logs"
    # torch alone first: resolved together with the rest, an unpinned requirement could pick a CUDA build.
    local pip=("$PYTHON" -m pip wheel --wheel-dir "$WHEELS")
    timed "wheelhouse: torch" "${pip[@]}" -r <("$PYTHON" "$ROOT/scripts/requirements.py" torch) \
        >"$CACHE/logs/wheelhouse.log" 2>&1 || die "pip wheel failed; log $CACHE/logs/wheelhouse.log"
    timed "wheelhouse: the rest" "${pip[@]}" -r <(echo "$requirements") \
        >>"$CACHE/logs/wheelhouse.log" 2>&1 || die "pip wheel failed; log $CACHE/logs/wheelhouse.log"
    echo "$wanted" >"$stamp"
}

serve_wheelhouse() {  # sets WHEELS_URL; the server stops with this script
    # The URL is a build argument of the runtime image, so it is part of its layers' cache key: the same port every
    # time (one derived from the wheelhouse's path), so that a second build reuses the layers that installed the
    # wheels instead of installing them again; a random free port only where that one is taken.
    local port
    port="$("$PYTHON" -c '
import socket, sys, zlib
for port in (20000 + zlib.crc32(sys.argv[1].encode()) % 20000, 0):
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server binds: past TIME_WAIT
            s.bind(("127.0.0.1", port))
            print(s.getsockname()[1])
            break
    except OSError:
        continue' "$WHEELS")"
    "$PYTHON" -m http.server --bind 127.0.0.1 --directory "$WHEELS" "$port" >/dev/null 2>&1 3>&- &
    WHEELS_SERVER=$!
    trap 'kill "$WHEELS_SERVER" 2>/dev/null || true' EXIT
    WHEELS_URL="http://127.0.0.1:$port/"
    for _ in $(seq 50); do curl -fs -o /dev/null "$WHEELS_URL" && return; sleep 0.1; done
    die "the wheelhouse server did not start"
}

# --- the images ----------------------------------------------------------------------------------------------
build() {  # build IMAGE DOCKER-BUILD-ARGS...: docker build's output goes to $CACHE/logs/IMAGE.log
    local image="$1" logfile="$CACHE/logs/${1%%:*}.log" start="$SECONDS"
    shift
    mkdir -p "$CACHE/logs"
    "$DOCKER" build --network host -t "$image" "$@" >"$logfile" 2>&1 || { tail -n 30 "$logfile" >&2; die "$image failed; log $logfile"; }
    log "$image: $((SECONDS - start))s"
}

build_redis() {
    # The stand-in for redis:7.0: redis-server and redis-cli on PATH, /data writable by its non-root user.
    build "reinforce-redis:$VERSION" - <<EOF
FROM $BASE_IMAGE
RUN useradd --uid 1000 --user-group --create-home redis-user && install -d -o 1000 -g 1000 /data
USER 1000
WORKDIR /data
EXPOSE 6379
HEALTHCHECK --interval=5s --timeout=3s CMD redis-cli ping | grep -q PONG
CMD ["redis-server", "--dir", "/data", "--appendonly", "yes"]
EOF
}

build_prometheus() {
    # Debian's Prometheus (the one the tests run on the host), as the package's non-root `prometheus` user with its
    # data folder; docker-compose.yml gives it its command and compose/prometheus.yml. The apt lists are fetched for
    # the install and removed again.
    build "reinforce-prometheus:$VERSION" - <<EOF
FROM $BASE_IMAGE
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb
USER prometheus
WORKDIR /var/lib/prometheus
EXPOSE 9090
CMD ["prometheus", "--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/var/lib/prometheus/metrics2"]
EOF
}

check_runtime() {
    local image="reinforce-runtime:$VERSION"
    "$DOCKER" run --rm --network none "$image" python -c \
        'import reinforce.cli, torch; assert torch.version.cuda is None, torch.version.cuda; print("torch", torch.__version__)' \
        >/dev/null || die "$image: python cannot import torch and reinforce (CPU)"
    local cuda
    cuda="$("$DOCKER" run --rm --network none "$image" sh -c 'pip list --format=freeze | grep -i "^nvidia-" | grep -iv "^nvidia-pytriton=" || true')"
    [ -z "$cuda" ] || die "$image holds CUDA packages: $cuda"
    log "checked $image: python imports torch (CPU) and reinforce; no nvidia-* CUDA packages"
}

main() {
    case "${1:-build}" in
        build) ;;
        stop-dockerd) stop_dockerd; return ;;
        *) die "usage: $0 [build|stop-dockerd]" ;;
    esac
    mkdir -p "$CACHE"
    ensure_docker
    timed "base image $BASE_IMAGE" build_base
    timed "wheelhouse $WHEELS" build_wheelhouse
    serve_wheelhouse
    build "reinforce-runtime:$VERSION" -f "$ROOT/services/reinforce/core/Dockerfile" \
        --build-arg BASE="$BASE_IMAGE" --build-arg WHEELS="$WHEELS_URL" "$ROOT"
    check_runtime
    local service
    for service in "${SERVICES[@]}"; do
        build "reinforce-$service:$VERSION" -f "$ROOT/services/reinforce/$service/Dockerfile" "$ROOT"
    done
    build_redis
    build_prometheus
    "$DOCKER" image ls --format '{{.Repository}}:{{.Tag}}\t{{.Size}}' | grep '^reinforce-' | sort >&2
    log "done in ${SECONDS}s"
}

main "$@"
