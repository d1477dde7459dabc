#!/usr/bin/env bash
# Build kube-apiserver and kube-controller-manager for the test suite, then print the folder that holds them.
#
# Usage: tests/integration/k8s-test-cluster.sh     # prints e.g. /root/.cache/reinforce-k8s/bin
#        REINFORCE_K8S_CACHE=/some/dir tests/integration/k8s-test-cluster.sh
#        tests/integration/k8s-test-cluster.sh --node  # also kube-scheduler, kubelet and a static pause binary (or
#                                            # REINFORCE_K8S_NODE=1), for tests/e2e/k8s-single-node.sh
#
# Debian ships no Kubernetes binaries, but its `kubernetes` source package (1.20.2, vendored dependencies
# included) builds with Debian's golang-go: about 6-8 minutes on 2 cores the first time, 2 minutes with a warm
# Go build cache. The binaries and Go's build cache live in ${REINFORCE_K8S_CACHE:-$HOME/.cache/reinforce-k8s},
# outside the clone, so a later run on the same machine only checks the apt packages and prints the folder
# (0.1 s). It also installs etcd-server and openssl, which the tests run beside the API server.
# Non-interactive (root, or sudo for apt-get), idempotent, and safe to run concurrently (a lock serialises it).
# Only the bin folder goes to stdout; progress goes to stderr.
set -euo pipefail
shopt -s inherit_errexit  # a failing command inside $(...) fails the script too

CACHE="${REINFORCE_K8S_CACHE:-$HOME/.cache/reinforce-k8s}"
BIN="$CACHE/bin"
COMPONENTS=(kube-apiserver kube-controller-manager)
# Bump when the recipe changes so that cached binaries built by an older recipe are rebuilt.
RECIPE=1
# --node: the node's components too. They are built only when asked for and recorded by their own recipe
# number, so the default build (and its output) stays as it was.
NODE_COMPONENTS=(kube-scheduler kubelet)
NODE_RECIPE=1
NODE=0
[ "${1:-}" != "--node" ] && [ "${REINFORCE_K8S_NODE:-0}" != "1" ] || NODE=1
# make, rsync and jq: what the source package builds with (its Build-Depends); openssl: the tests' certificates.
APT_PACKAGES=(golang-go etcd-server dpkg-dev golang-github-modern-go-reflect2-dev make rsync jq openssl ca-certificates)

log() { echo "k8s-test-cluster: $*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

install_apt_packages() {
    local missing=() pkg
    for pkg in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return
    log "installing ${missing[*]}"
    as_root apt-get update -qq >&2
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

built() {
    local c
    for c in "${COMPONENTS[@]}"; do [ -x "$BIN/$c" ] || return 1; done
    [ "$(cat "$BIN/.recipe" 2>/dev/null)" = "$RECIPE" ]
}

node_built() {
    local c
    for c in "${NODE_COMPONENTS[@]}" pause; do [ -x "$BIN/$c" ] || return 1; done
    [ "$(cat "$BIN/.node-recipe" 2>/dev/null)" = "$NODE_RECIPE" ]
}

# deb-src lines for the machine's own Debian archives (those serving its release), written to our own sources
# file: the system's apt configuration is never changed.
derive_deb_src() {
    local codename out="$1"
    codename="$(. /etc/os-release && echo "$VERSION_CODENAME")"
    python3 - "$codename" >"$out" <<'PY'
import glob, re, sys

codename = sys.argv[1]
out = []
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in re.split(r"\n\s*\n", open(path).read()):
        fields = dict(re.findall(r"^([A-Za-z-]+):\s*(.*)$", stanza, re.M))
        suites = fields.get("Suites", "").split()
        if "deb" in fields.get("Types", "").split() and fields.get("Enabled", "yes") != "no" and any(
            s.startswith(codename) for s in suites
        ):
            opts = f"[signed-by={fields['Signed-By']}] " if "Signed-By" in fields else ""
            for uri in fields["URIs"].split():
                for suite in suites:
                    out.append(f"deb-src {opts}{uri} {suite} {fields.get('Components', 'main')}")
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
    try:
        lines = open(path).read().splitlines()
    except FileNotFoundError:
        continue
    for line in lines:
        parts = line.split()
        if parts and parts[0] == "deb" and any(p.startswith(codename) for p in parts[1:]):
            out.append("deb-src" + line.strip()[3:])
print("\n".join(dict.fromkeys(out)))
PY
    [ -s "$out" ] || { log "found no Debian $codename archive in /etc/apt to derive deb-src from"; exit 1; }
}

fetch_source() {
    local work="$CACHE/apt" tree
    mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
    derive_deb_src "$work/deb-src.list"
    # Our own lists folder and sources file: the system's apt state stays as it was.
    local apt_opts=(-o "Dir::Etc::SourceList=$work/deb-src.list" -o "Dir::Etc::SourceParts=-"
        -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache")
    # apt's download user (_apt) cannot enter a root-owned cache folder; root downloads itself, quietly.
    [ "$(id -u)" -ne 0 ] || apt_opts+=(-o "APT::Sandbox::User=root")
    log "fetching Debian's kubernetes source package"
    apt-get "${apt_opts[@]}" update -qq >&2
    rm -rf "$CACHE/src" && mkdir -p "$CACHE/src"
    (cd "$CACHE/src" && apt-get "${apt_opts[@]}" source -qq kubernetes >&2)
    tree="$(find "$CACHE/src" -mindepth 1 -maxdepth 1 -type d -name 'kubernetes-*' | head -1)"
    [ -n "$tree" ] || { log "apt-get source kubernetes unpacked nothing"; exit 1; }
    echo "$tree"
}

# The vendored reflect2 v1.0.1 reads Go runtime internals that changed in Go 1.18: under Debian's Go 1.19 the
# API server crashes on custom-resource requests. Debian's packaged reflect2 (1.0.2) is fixed.
replace_reflect2() {
    local tree="$1" src=/usr/share/gocode/src/github.com/modern-go/reflect2
    [ -d "$src" ] || { log "$src missing (golang-github-modern-go-reflect2-dev)"; exit 1; }
    rm -rf "$tree/vendor/github.com/modern-go/reflect2"
    mkdir -p "$tree/vendor/github.com/modern-go/reflect2"
    find "$src" -maxdepth 1 -type f -name '*.go' ! -name '*_test.go' -exec cp {} "$tree/vendor/github.com/modern-go/reflect2/" \;
    find "$src" -maxdepth 1 -type f -name '*.s' -exec cp {} "$tree/vendor/github.com/modern-go/reflect2/" \;
}

# This machine class lacks CAP_SYS_RESOURCE: no process may lower an oom_score_adj below 0, and runc then fails
# every pod sandbox that asks for one ("can't get final child's PID from pipe: EOF"). dockershim gives sandboxes
# -998 and the kubelet gives Guaranteed and critical pods -997, both constants: make them 0. Only the kubelet
# imports these packages, so kube-apiserver and kube-controller-manager are unchanged by it.
patch_node_oom_scores() {
    local tree="$1"
    sed -i 's/^\(\s*defaultSandboxOOMAdj int = \)-998$/\10/' "$tree/pkg/kubelet/dockershim/docker_sandbox.go"
    sed -i 's/^\(\s*guaranteedOOMScoreAdj int = \)-997$/\10/' "$tree/pkg/kubelet/qos/policy.go"
    if ! grep -Eq '^\s*defaultSandboxOOMAdj int = 0$' "$tree/pkg/kubelet/dockershim/docker_sandbox.go" ||
        ! grep -Eq '^\s*guaranteedOOMScoreAdj int = 0$' "$tree/pkg/kubelet/qos/policy.go"; then
        log "the OOM score constants moved in this source tree: cannot patch them"
        exit 1
    fi
}

build() {
    local tree="$1" c
    shift
    local COMPONENTS=("$@")  # what to build this time (a subset when only the node's components are missing)
    log "building ${COMPONENTS[*]} (about 6 minutes on 2 cores; Go's build cache: $CACHE/go-build)"
    # Upstream's make, as Debian's rules run it: it generates the OpenAPI definitions the tarball lacks and
    # stamps the release version (v1.20.2, from the archive) into the binaries. Kubernetes 1.20 builds in
    # GOPATH mode; in module mode Go 1.19 refuses its go.mod ("updates to go.mod needed").
    # The make scripts put Go's build cache inside the tree: a link keeps it in the cache folder instead.
    mkdir -p "$tree/_output/local/go" "$CACHE/go-build"
    ln -sfn "$CACHE/go-build" "$tree/_output/local/go/cache"
    local what="${COMPONENTS[*]/#/cmd/}"
    (cd "$tree" && env -u GOFLAGS GO111MODULE=off GOPROXY=off make WHAT="$what" GOLDFLAGS="-s -w" >&2)
    rm -rf "$CACHE/out" && mkdir -p "$CACHE/out"
    for c in "${COMPONENTS[@]}"; do cp "$tree/_output/bin/$c" "$CACHE/out/$c"; done
    if [ "$NODE" = 1 ]; then
        # The pod sandbox image's one binary, from the same tree; k8s-single-node.sh `docker import`s it.
        gcc -Os -Wall -static -DVERSION=v1.20-reinforce -o "$CACHE/out/pause" "$tree/build/pause/linux/pause.c"
        echo "$NODE_RECIPE" >"$CACHE/out/.node-recipe"
    fi
    if [ "${COMPONENTS[0]}" = kube-apiserver ]; then
        # Swap the finished binaries in at once, so an interrupted build never leaves a half-filled bin folder.
        echo "$RECIPE" >"$CACHE/out/.recipe"
        rm -rf "$BIN" && mv "$CACHE/out" "$BIN"
    else
        # Only the node's files: rename each into place (atomic), leaving the control plane's binaries, which
        # a test session may be starting right now, untouched. The recipe marker goes last.
        for c in "${NODE_COMPONENTS[@]}" pause .node-recipe; do mv -f "$CACHE/out/$c" "$BIN/$c"; done
        rm -rf "$CACHE/out"
    fi
    # The unpacked tree (~0.8 GB) is not needed any more; Go's build cache stays for the next rebuild.
    rm -rf "$CACHE/src"
}

main() {
    mkdir -p "$CACHE"
    exec 9>"$CACHE/.lock"
    flock 9
    [ "$NODE" = 0 ] || APT_PACKAGES+=(gcc libc6-dev)  # the static pause binary
    install_apt_packages
    local wanted=()
    built || wanted+=("${COMPONENTS[@]}")
    [ "$NODE" = 0 ] || node_built || wanted+=("${NODE_COMPONENTS[@]}")
    if [ ${#wanted[@]} -gt 0 ]; then
        local start=$SECONDS tree
        tree="$(fetch_source)"
        replace_reflect2 "$tree"
        [ "$NODE" = 0 ] || patch_node_oom_scores "$tree"
        build "$tree" "${wanted[@]}"
        log "built in $((SECONDS - start)) s"
    fi
    echo "$BIN"
}

main "$@"
