#!/usr/bin/env bash
# A whole single-node Kubernetes 1.20 cluster on loopback, and a teardown that leaves the machine as it found it.
#
# Usage: tests/e2e/k8s-single-node.sh up       # build (first time) and start; waits for node Ready and a pod Running
#        tests/e2e/k8s-single-node.sh status   # up or not, the kubeconfig, the node's readiness (exit 0: up and Ready,
#                                            # 1: started but not healthy, 3: not up)
#        tests/e2e/k8s-single-node.sh env      # `eval "$(tests/e2e/k8s-single-node.sh env)"`: KUBECONFIG, DOCKER_HOST
#        tests/e2e/k8s-single-node.sh down     # stop everything, undo the machine changes, delete the state folder
# Environment: REINFORCE_K8S_STATE (state folder, default /run/reinforce-k8s), REINFORCE_K8S_CACHE (build cache,
# default ~/.cache/reinforce-k8s), REINFORCE_K8S_UP_TIMEOUT (seconds to wait for the node and the pod, default 180).
#
# What runs (all on 127.0.0.1, ports chosen free at `up`): etcd, kube-apiserver (RBAC + Node authorizer, an admin
# token in system:masters, ServiceAccount signing keys, serving certificate for 127.0.0.1), kube-controller-manager
# (ServiceAccount credentials, root CA), kube-scheduler, our own dockerd, and the kubelet with its built-in dockershim.
# There is no kube-proxy and no cluster DNS: pods use hostNetwork and reach each other and the API server on
# 127.0.0.1 ports. Images cannot be pulled (no registry is reachable): load them into our dockerd (`env` prints its
# DOCKER_HOST) and give pods `imagePullPolicy: Never`.
#
# Binaries come from tests/integration/k8s-test-cluster.sh --node (built from Debian's `kubernetes` source package once per
# machine, cached in ~/.cache/reinforce-k8s, with the kubelet's OOM-score constants set to 0 because this machine
# class lacks CAP_SYS_RESOURCE). All state lives in one folder that also records what `down` must undo: the PIDs it
# started, the sysctls the kubelet and dockerd change (read BEFORE they start), which of the kubelet's fixed paths
# existed before, and which cgroup hierarchies had no kubepods group. `down` is idempotent and also cleans up after
# a failed or interrupted `up`.
#
# A dockerd that is already running (the system's, on /var/run/docker.sock) is left alone: ours always runs beside it
# with its own socket ($STATE/docker.sock), data-root, exec-root, pidfile, config file and containerd namespace, and
# the kubelet is pointed at it with --docker-endpoint. `down` stops only processes whose PID (and start time) it
# recorded, and processes whose command line names our state folder (our dockerd's containerd shims).
# Needs root (cgroups, mounts, sysctls); installs Debian's docker.io when no dockerd is installed.
set -euo pipefail
shopt -s inherit_errexit  # a failing command inside $(...) fails the script too

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STATE="${REINFORCE_K8S_STATE:-/run/reinforce-k8s}"
UP_TIMEOUT="${REINFORCE_K8S_UP_TIMEOUT:-180}"
NODE_NAME=127.0.0.1          # --hostname-override: the node is named by, and gets InternalIP, 127.0.0.1
PAUSE_IMAGE=k8s.gcr.io/pause:3.2  # kubelet 1.20's default --pod-infra-container-image; we pass it explicitly too
SMOKE_POD=reinforce-smoke
MARKER=.reinforce-k8s-state  # written into the state folder first: `down` deletes no folder that lacks it
ADMIN_USER=reinforce-admin
SERVICE_ACCOUNT_ISSUER=https://kubernetes.default.svc.cluster.local
# Start order; `down` stops them in reverse order after the kubelet (first) and the pods' containers.
PROCESSES=(etcd kube-apiserver kube-controller-manager kube-scheduler dockerd kubelet)
# kubelet sets the first six (setupKernelTunables, unless --protect-kernel-defaults) and its no-op network plugin the
# bridge ones; dockerd would set ip_forward (we pass --ip-forward=false, and record it anyway).
SYSCTLS=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys
    kernel.keys.root_maxbytes net.bridge.bridge-nf-call-iptables net.bridge.bridge-nf-call-ip6tables
    net.ipv4.ip_forward)
# Paths the kubelet, dockerd and containerd use whatever their flags say (everything else is pointed into $STATE).
# Those that did not exist before `up` are removed by `down`; those that did are never touched.
#   /var/lib/kubelet: the device-plugin socket folder is a constant (/var/lib/kubelet/device-plugins);
#   /var/log/pods, /var/log/containers: the kubelet's container logs and their links, constants in 1.20;
#   /var/lib/dockershim: dockershim's default root (we pass --experimental-dockershim-root-directory; recorded anyway).
#   /var/run/dockershim.sock, /usr/libexec/kubernetes: the defaults of flags we set (recorded anyway).
FIXED_PATHS=(/var/lib/kubelet /var/log/pods /var/log/containers /var/lib/dockershim /var/run/dockershim.sock
    /usr/libexec/kubernetes)
# Shared folders another program may start using while we are up: removed only if they were absent and are empty
# (deepest first).
#   /run/containerd/s: containerd's shim sockets (a constant in containerd 1.5+); /opt/containerd: containerd's
#   "opt" plugin (dockerd gives its managed containerd no way to move it); /run/docker/plugins: dockerd's plugin
#   discovery folder; /run/mount: libmount's lock folder (the kubelet mounts pods' secret volumes with mount(8));
#   /etc/docker: dockerd's config folder (ours reads $STATE/docker-daemon.json and keeps its key in $STATE).
SHARED_DIRS=(/run/containerd/s /run/containerd /opt/containerd/bin /opt/containerd/lib /opt/containerd
    /run/docker/plugins /run/docker /run/mount /etc/docker)

log() { echo "k8s-single-node: $*" >&2; }
die() { log "$*"; exit 1; }

case "$STATE" in
/?*/?* | /run/?* | /tmp/?*) ;;  # absolute, and not a top-level system folder
*) die "REINFORCE_K8S_STATE must be an absolute path below a top-level folder (got '$STATE')" ;;
esac
STATE="${STATE%/}"
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# ---- processes -------------------------------------------------------------------------------------------------
# A recorded PID is trusted only while its start time (field 22 of /proc/PID/stat) is the one recorded, so a PID the
# kernel has since given to another program is never signalled. Zombies count as gone.
proc_start_time() {
    local stat
    stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
    stat="${stat##*) }"  # the fields after the command name (which may hold spaces)
    # shellcheck disable=SC2086
    set -- $stat
    [ "$1" != Z ] || return 1
    echo "${20}"
}

recorded_alive() {  # name -> prints the PID when the recorded process still runs
    local pid start
    [ -f "$STATE/pids/$1" ] || return 1
    read -r pid start <"$STATE/pids/$1"
    [ -n "$pid" ] && [ "$(proc_start_time "$pid" 2>/dev/null)" = "$start" ] || return 1
    echo "$pid"
}

spawn() {  # name command...: started in its own session (no terminal signals), log in $STATE/logs/name.log
    local name="$1" pid start
    shift
    # A background job of a non-interactive shell is no process-group leader, so setsid(1) calls setsid() and execs
    # in the same process: $! is the program's own PID.
    # 8<&-: the daemons must not inherit the up/down lock, or the next `down` would wait for them forever.
    setsid "$@" >>"$STATE/logs/$name.log" 2>&1 </dev/null 8<&- &
    pid=$!
    start="$(proc_start_time "$pid")" || die "$name exited at once; the end of its log:$(tail_log "$name")"
    echo "$pid $start" >"$STATE/pids/$name"
}

stop_recorded() {  # name [seconds]: TERM, then KILL after the grace period
    local name="$1" grace="${2:-20}" pid i
    pid="$(recorded_alive "$name")" || { rm -f "$STATE/pids/$name"; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < grace * 10; i++)); do
        recorded_alive "$name" >/dev/null || break
        sleep 0.1
    done
    if recorded_alive "$name" >/dev/null; then
        log "$name (pid $pid) ignored SIGTERM for ${grace} s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        for ((i = 0; i < 50; i++)); do recorded_alive "$name" >/dev/null || break; sleep 0.1; done
    fi
    recorded_alive "$name" >/dev/null && return 1
    rm -f "$STATE/pids/$name"
}

# Our dockerd's containerd and its shims: container-runtime programs whose command line names our state folder
# (a user's `tail -f $STATE/logs/...` names it too, and is left alone).
runtime_pids_naming_state() {
    local f pid exe
    for f in /proc/[0-9]*/cmdline; do
        pid="${f#/proc/}" && pid="${pid%/cmdline}"
        exe="$(readlink "/proc/$pid/exe" 2>/dev/null)" || continue
        case "${exe##*/}" in containerd* | runc | dockerd | docker-*) ;; *) continue ;; esac
        if tr '\0' ' ' <"$f" 2>/dev/null | grep -qF -- "$STATE/"; then echo "$pid"; fi
    done
}

tail_log() { [ -f "$STATE/logs/$1.log" ] && { echo; tail -n 25 "$STATE/logs/$1.log"; } || true; }

# ---- the machine's state before `up` ---------------------------------------------------------------------------
cgroup_hierarchies() {  # every mounted cgroup hierarchy (v1 controllers, name=systemd, the v2 unified one)
    findmnt -rn -t cgroup,cgroup2 -o TARGET
}

record_before() {
    local name path h
    mkdir -p "$STATE/before"
    for name in "${SYSCTLS[@]}"; do
        if [ -r "/proc/sys/${name//.//}" ]; then echo "$name $(cat "/proc/sys/${name//.//}")"; fi
    done >"$STATE/before/sysctls"
    for path in "${FIXED_PATHS[@]}" "${SHARED_DIRS[@]}"; do
        if [ ! -e "$path" ] && [ ! -L "$path" ]; then echo "$path"; fi
    done >"$STATE/before/absent-paths"
    for h in $(cgroup_hierarchies); do
        if [ ! -e "$h/kubepods" ]; then echo "$h"; fi
    done >"$STATE/before/cgroups-without-kubepods"
}

# ---- certificates and kubeconfigs --------------------------------------------------------------------------------
openssl_q() { (cd "$STATE/pki" && openssl "$@" >/dev/null 2>&1) || die "openssl $* failed"; }

issue() {  # name subject extensions: a certificate signed by our CA
    local name="$1" subject="$2" ext="$3"
    printf '%b' "$ext" >"$STATE/pki/$name.ext"
    openssl_q req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$name.key" -out "$name.csr" \
        -subj "$subject"
    openssl_q x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -out "$name.crt" \
        -extfile "$name.ext"
}

make_pki() {
    mkdir -p "$STATE/pki"
    chmod 700 "$STATE/pki"
    openssl_q req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key -out ca.crt \
        -days 3650 -subj /CN=reinforce-single-node-ca -addext basicConstraints=critical,CA:TRUE \
        -addext keyUsage=critical,keyCertSign,cRLSign
    local client='extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature\n'
    local serving='extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature\n'
    issue apiserver /CN=kube-apiserver "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n$serving"
    issue kubelet-serving "/CN=system:node:$NODE_NAME/O=system:nodes" "subjectAltName=IP:127.0.0.1,DNS:localhost\n$serving"
    # The API server's identity towards the kubelet (logs, exec): system:masters passes the kubelet's webhook check.
    issue apiserver-kubelet-client /CN=kube-apiserver-kubelet-client/O=system:masters "$client"
    # Each component as itself, as kubeadm sets them up: the Node authorizer and the bootstrap RBAC roles apply.
    issue kubelet "/CN=system:node:$NODE_NAME/O=system:nodes" "$client"
    issue controller-manager /CN=system:kube-controller-manager "$client"
    issue scheduler /CN=system:kube-scheduler "$client"
    openssl_q genrsa -out sa.key 2048
    ADMIN_TOKEN="$(openssl rand -hex 16)"
    echo "$ADMIN_TOKEN,$ADMIN_USER,$ADMIN_USER,\"system:masters\"" >"$STATE/pki/tokens.csv"
    chmod 600 "$STATE/pki/tokens.csv"
}

kubeconfig() {  # file user credential-lines: a kubeconfig that embeds everything, so it works from any folder
    local file="$1" user="$2" credentials="$3"
    cat >"$file" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: reinforce-single-node
  cluster:
    server: $API_SERVER
    certificate-authority-data: $(base64 -w0 "$STATE/pki/ca.crt")
users:
- name: $user
  user:
$credentials
contexts:
- name: reinforce-single-node
  context: {cluster: reinforce-single-node, user: $user, namespace: default}
current-context: reinforce-single-node
EOF
    chmod 600 "$file"
}

cert_credentials() {
    printf '    client-certificate-data: %s\n    client-key-data: %s' \
        "$(base64 -w0 "$STATE/pki/$1.crt")" "$(base64 -w0 "$STATE/pki/$1.key")"
}

# ---- talking to the API server (curl + jq: no kubectl of a matching version is needed) ---------------------------
load_env() {
    [ -f "$STATE/env" ] || return 1
    # shellcheck disable=SC1091
    . "$STATE/env"
    ADMIN_TOKEN="$(cut -d, -f1 "$STATE/pki/tokens.csv" 2>/dev/null)" || return 1
}

api() {  # method path [json-body]
    local args=(-sS --fail --max-time 10 --cacert "$STATE/pki/ca.crt" -H "Authorization: Bearer $ADMIN_TOKEN"
        -X "$1" "$API_SERVER$2")
    [ $# -lt 3 ] || args+=(-H "Content-Type: application/json" --data-binary "$3")
    curl "${args[@]}"
}

node_ready() {
    [ "$(api GET "/api/v1/nodes/$NODE_NAME" 2>/dev/null |
        jq -r '.status.conditions[]? | select(.type == "Ready") | .status')" = True ]
}

# N distinct free ports below the kernel's ephemeral range: the servers bind them seconds later (kubelet last), and
# a port from the ephemeral range can meanwhile become the local end of some outgoing connection (CI saw kubelet's
# healthz port taken for a whole minute).
free_ports() {
    python3 - "$1" <<'PY'
import random, socket, sys
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
ports = set()
while len(ports) < int(sys.argv[1]):
    port = random.randint(10000, low - 1)
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    ports.add(port)
print(*ports)
PY
}

wait_for() {  # description timeout-seconds process-to-watch command...
    local what="$1" timeout="$2" watch="$3" deadline
    shift 3
    deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        [ -z "$watch" ] || recorded_alive "$watch" >/dev/null ||
            die "$watch exited while waiting for $what; the end of its log:$(tail_log "$watch")"
        [ $SECONDS -lt $deadline ] || die "$what: not within ${timeout} s; the end of ${watch:-the} log:$(tail_log "$watch")"
        sleep 0.2
    done
}

# ---- up ----------------------------------------------------------------------------------------------------------
ensure_packages() {
    local missing=()
    command -v dockerd >/dev/null || missing+=(docker.io)  # any installed dockerd will do
    command -v curl >/dev/null || missing+=(curl)
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing ${missing[*]}"
        # DPkg::Lock::Timeout: another session may be installing packages at the same moment; wait for it.
        apt-get -o DPkg::Lock::Timeout=600 update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
            "${missing[@]}" >&2
    fi
    DOCKERD="$(command -v dockerd)"
    # The client of the docker.io package; any docker client works (the API version is negotiated).
    DOCKER="$( [ -x /usr/bin/docker ] && echo /usr/bin/docker || command -v docker)" ||
        die "no docker client (docker.io ships /usr/bin/docker)"
}

docker_() { "$DOCKER" -H "unix://$STATE/docker.sock" "$@"; }

preflight() {
    [ "$(uname -s)" = Linux ] || die "needs Linux"
    [ -n "$(cgroup_hierarchies)" ] || die "no cgroup file system is mounted"
    local h
    for h in $(cgroup_hierarchies); do
        [ ! -e "$h/kubepods" ] || die "$h/kubepods exists: another kubelet (another cluster?) runs on this machine"
    done
    [ -w "$(findmnt -rn -t cgroup,cgroup2 -o TARGET | head -1)" ] || die "the cgroup file system is read-only here"
}

start_control_plane() {
    local etcd_client_port etcd_peer_port api_port etcd_client etcd_peer
    read -r etcd_client_port etcd_peer_port api_port KUBELET_PORT KUBELET_HEALTHZ_PORT < <(free_ports 5)
    etcd_client="http://127.0.0.1:$etcd_client_port"
    etcd_peer="http://127.0.0.1:$etcd_peer_port"
    API_SERVER="https://127.0.0.1:$api_port"
    cat >"$STATE/env" <<EOF
API_SERVER=$API_SERVER
ETCD_URL=$etcd_client
KUBELET_PORT=$KUBELET_PORT
KUBELET_HEALTHZ_PORT=$KUBELET_HEALTHZ_PORT
EOF
    spawn etcd "$(command -v etcd)" --name single-node --data-dir "$STATE/etcd" \
        --listen-client-urls "$etcd_client" --advertise-client-urls "$etcd_client" \
        --listen-peer-urls "$etcd_peer" --initial-advertise-peer-urls "$etcd_peer" \
        --initial-cluster "single-node=$etcd_peer" --logger zap --log-level warn
    wait_for etcd 30 etcd curl -sf "$etcd_client/health"

    spawn kube-apiserver "$BIN/kube-apiserver" --etcd-servers="$etcd_client" \
        --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$api_port" --insecure-port=0 \
        --tls-cert-file="$STATE/pki/apiserver.crt" --tls-private-key-file="$STATE/pki/apiserver.key" \
        --client-ca-file="$STATE/pki/ca.crt" --token-auth-file="$STATE/pki/tokens.csv" \
        --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
        --service-cluster-ip-range=10.96.0.0/24 --allow-privileged=true --profiling=false \
        --service-account-key-file="$STATE/pki/sa.key" --service-account-signing-key-file="$STATE/pki/sa.key" \
        --service-account-issuer="$SERVICE_ACCOUNT_ISSUER" \
        --kubelet-preferred-address-types=InternalIP --kubelet-certificate-authority="$STATE/pki/ca.crt" \
        --kubelet-client-certificate="$STATE/pki/apiserver-kubelet-client.crt" \
        --kubelet-client-key="$STATE/pki/apiserver-kubelet-client.key"
    wait_for kube-apiserver 60 kube-apiserver api GET /readyz

    mkdir -p "$STATE/kubeconfigs"
    kubeconfig "$STATE/admin.kubeconfig" "$ADMIN_USER" "    token: $ADMIN_TOKEN"
    kubeconfig "$STATE/kubeconfigs/controller-manager.yaml" system:kube-controller-manager \
        "$(cert_credentials controller-manager)"
    kubeconfig "$STATE/kubeconfigs/scheduler.yaml" system:kube-scheduler "$(cert_credentials scheduler)"
    kubeconfig "$STATE/kubeconfigs/kubelet.yaml" "system:node:$NODE_NAME" "$(cert_credentials kubelet)"

    spawn kube-controller-manager "$BIN/kube-controller-manager" \
        --kubeconfig="$STATE/kubeconfigs/controller-manager.yaml" \
        --controllers='*' --use-service-account-credentials=true --leader-elect=false --port=0 --secure-port=0 \
        --root-ca-file="$STATE/pki/ca.crt" --service-account-private-key-file="$STATE/pki/sa.key" \
        --cluster-signing-cert-file="$STATE/pki/ca.crt" --cluster-signing-key-file="$STATE/pki/ca.key"
    spawn kube-scheduler "$BIN/kube-scheduler" --kubeconfig="$STATE/kubeconfigs/scheduler.yaml" \
        --leader-elect=false --port=0 --secure-port=0
}

start_docker() {
    # Our own config file: the system's /etc/docker/daemon.json (if any) is another dockerd's business. It puts the
    # daemon's identity key in the state folder, not in /etc/docker/key.json (dockerd 20.10 has no flag for that).
    echo "{\"deprecated-key-path\": \"$STATE/docker-key.json\"}" >"$STATE/docker-daemon.json"
    # --iptables/--ip-masq/--ip-forward=false, --bridge=none: no network set-up at all (pods use the host's network);
    # cgroupfs, the kubelet's driver; our own containerd namespace, in case dockerd finds a system containerd.
    spawn dockerd "$DOCKERD" --host="unix://$STATE/docker.sock" --data-root="$STATE/docker" \
        --exec-root="$STATE/docker-exec" --pidfile="$STATE/docker.pid" --config-file="$STATE/docker-daemon.json" \
        --iptables=false --ip-masq=false --ip-forward=false --bridge=none \
        --exec-opt native.cgroupdriver=cgroupfs \
        --containerd-namespace=reinforce-k8s --containerd-plugins-namespace=reinforce-k8s-plugins --log-level=warn
    wait_for dockerd 60 dockerd docker_ version
    # The pod sandbox image: the tree's pause.c, compiled statically by the build script, is its only file.
    local rootfs="$STATE/pause-rootfs"
    mkdir -p "$rootfs"
    cp "$BIN/pause" "$rootfs/pause"
    tar -C "$rootfs" -c pause | docker_ import -c 'ENTRYPOINT ["/pause"]' - "$PAUSE_IMAGE" >/dev/null
    rm -rf "$rootfs"
}

start_kubelet() {
    # --root-dir, --experimental-dockershim-root-directory, --container-runtime-endpoint (dockershim's CRI socket) and
    # --volume-plugin-dir point the kubelet's own files into the state folder (the FlexVolume prober would otherwise
    # create /usr/libexec/kubernetes, dockershim /var/run/dockershim.sock). --hostname-override
    # gives the node the InternalIP 127.0.0.1 (--node-ip=127.0.0.1 is refused). --oom-score-adj=0: no
    # CAP_SYS_RESOURCE. Eviction thresholds and image GC are relaxed: imported images cannot be pulled again. The node's
    # status is computed every 2 s instead of 10 (it is sent only when it changes): the node is Ready ~10 s sooner.
    spawn kubelet "$BIN/kubelet" --kubeconfig="$STATE/kubeconfigs/kubelet.yaml" \
        --hostname-override="$NODE_NAME" --address=127.0.0.1 --port="$KUBELET_PORT" --read-only-port=0 \
        --healthz-bind-address=127.0.0.1 --healthz-port="$KUBELET_HEALTHZ_PORT" \
        --tls-cert-file="$STATE/pki/kubelet-serving.crt" --tls-private-key-file="$STATE/pki/kubelet-serving.key" \
        --client-ca-file="$STATE/pki/ca.crt" --anonymous-auth=false --authorization-mode=Webhook \
        --container-runtime=docker --docker-endpoint="unix://$STATE/docker.sock" \
        --container-runtime-endpoint="unix://$STATE/dockershim.sock" \
        --pod-infra-container-image="$PAUSE_IMAGE" --cgroup-driver=cgroupfs --oom-score-adj=0 \
        --make-iptables-util-chains=false --fail-swap-on=false \
        --root-dir="$STATE/kubelet" --experimental-dockershim-root-directory="$STATE/dockershim" \
        --volume-plugin-dir="$STATE/kubelet-plugins/volume/exec" \
        --eviction-hard='memory.available<100Mi,nodefs.available<1%,imagefs.available<1%' \
        --image-gc-high-threshold=100 --image-gc-low-threshold=99 --node-status-update-frequency=2s
    wait_for "kubelet healthz" 60 kubelet curl -sf "http://127.0.0.1:$KUBELET_HEALTHZ_PORT/healthz"
}

smoke_pod() {
    cat <<EOF
{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "$SMOKE_POD", "namespace": "default"},
 "spec": {"hostNetwork": true, "terminationGracePeriodSeconds": 1,
          "containers": [{"name": "pause", "image": "$PAUSE_IMAGE", "imagePullPolicy": "Never"}]}}
EOF
}

smoke_pod_created() {  # created now, or by an earlier POST whose answer was lost
    api POST /api/v1/namespaces/default/pods "$(smoke_pod)" || api GET "/api/v1/namespaces/default/pods/$SMOKE_POD"
}
pod_running() { [ "$(api GET "/api/v1/namespaces/default/pods/$SMOKE_POD" | jq -r .status.phase)" = Running ]; }

pod_events() {
    api GET "/api/v1/namespaces/default/events?fieldSelector=involvedObject.name=$SMOKE_POD" 2>/dev/null |
        jq -r '.items[] | "  \(.reason): \(.message)"' || true
}

cmd_up() {
    [ "$(id -u)" -eq 0 ] || die "needs root (cgroups, mounts, sysctls); run it with sudo"
    mkdir -p "$(dirname "$STATE")"
    exec 8<"$(dirname "$STATE")"  # one `up`/`down` at a time: a lock on the parent folder (no file left over)
    flock -w 1800 8 || die "another up or down holds the lock on $(dirname "$STATE") for 30 minutes"
    if [ -f "$STATE/up.ok" ] && status_quiet; then
        log "already up"
        print_status
        return 0
    fi
    if [ -e "$STATE" ]; then
        log "$STATE holds a cluster that is not healthy (a failed or interrupted up): cleaning it up first"
        cmd_down_locked
    fi
    preflight
    local t0 t
    t0="$(now)"
    t="$t0"
    BIN="$(bash "$REPO/tests/integration/k8s-test-cluster.sh" --node)"
    ensure_packages
    local t_bin
    t_bin="$(elapsed "$t")"

    mkdir "$STATE"  # fails if it exists: a folder we did not make is never used, nor deleted by `down`
    touch "$STATE/$MARKER"
    chmod 700 "$STATE"
    mkdir -p "$STATE/pids" "$STATE/logs"
    record_before  # before anything changes the machine
    t="$(now)"
    make_pki
    start_control_plane
    local t_cp
    t_cp="$(elapsed "$t")"
    t="$(now)"
    start_docker
    local t_docker
    t_docker="$(elapsed "$t")"
    t="$(now)"
    start_kubelet
    wait_for "node $NODE_NAME Ready" "$UP_TIMEOUT" kubelet node_ready
    local t_node
    t_node="$(elapsed "$t")"

    t="$(now)"
    # Pods are refused until the controller-manager has made the namespace's default ServiceAccount, and then
    # with a 500 ("No API token found ... retry after the token is automatically created") until its token
    # controller has made the account's token Secret: a loaded machine widens that window, so the POST is retried.
    wait_for "the default ServiceAccount" 60 kube-controller-manager \
        api GET /api/v1/namespaces/default/serviceaccounts/default
    wait_for "the smoke pod accepted" 60 kube-controller-manager smoke_pod_created
    if ! wait_for_pod; then
        die "pod $SMOKE_POD did not reach Running in ${UP_TIMEOUT} s; its events:
$(pod_events)
the end of the kubelet's log:$(tail_log kubelet)"
    fi
    local t_pod
    t_pod="$(elapsed "$t")"
    api DELETE "/api/v1/namespaces/default/pods/$SMOKE_POD?gracePeriodSeconds=0" >/dev/null
    touch "$STATE/up.ok"
    echo "up in $(elapsed "$t0") s: binaries ${t_bin} s, control plane ${t_cp} s, dockerd + pause image" \
        "${t_docker} s, node Ready ${t_node} s, pod Running ${t_pod} s"
    print_status
}

wait_for_pod() {
    local deadline=$((SECONDS + UP_TIMEOUT))
    until pod_running 2>/dev/null; do
        recorded_alive kubelet >/dev/null || return 1
        [ $SECONDS -lt $deadline ] || return 1
        sleep 0.2
    done
}

# ---- status ------------------------------------------------------------------------------------------------------
status_quiet() {
    local name
    for name in "${PROCESSES[@]}"; do recorded_alive "$name" >/dev/null || return 1; done
    load_env && api GET /readyz >/dev/null 2>&1 && node_ready
}

print_status() {
    local name pid
    echo "state: $STATE"
    echo "kubeconfig: $STATE/admin.kubeconfig"
    echo "docker-host: unix://$STATE/docker.sock"
    load_env 2>/dev/null && echo "api-server: $API_SERVER"
    for name in "${PROCESSES[@]}"; do
        if pid="$(recorded_alive "$name")"; then echo "process: $name pid $pid running"
        else echo "process: $name not running"; fi
    done
    if load_env 2>/dev/null && node_ready 2>/dev/null; then echo "node: $NODE_NAME Ready"
    else echo "node: $NODE_NAME not Ready"; fi
}

cmd_status() {
    if [ ! -d "$STATE" ]; then
        echo "down (no $STATE)"
        return 3
    fi
    print_status
    if [ -f "$STATE/up.ok" ] && status_quiet; then echo "up"; return 0; fi
    echo "not healthy (a failed or interrupted up, or a component died): run down"
    return 1
}

cmd_env() {
    [ -f "$STATE/up.ok" ] || die "not up"
    echo "export KUBECONFIG=$STATE/admin.kubeconfig"
    echo "export DOCKER_HOST=unix://$STATE/docker.sock"
}

# ---- down --------------------------------------------------------------------------------------------------------
PROBLEMS=()
problem() { log "$*"; PROBLEMS+=("$*"); }

# Mount points under a folder, deepest first.
mounts_under() {
    findmnt -rn -o TARGET | awk -v p="$1/" 'index($0 "/", p) == 1' | awk '{ print length, $0 }' | sort -rn |
        cut -d' ' -f2-
}

unmount_under() {
    local m
    while read -r m; do
        [ -n "$m" ] || continue
        umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || problem "cannot unmount $m"
    done < <(mounts_under "$1")
}

was_absent() { [ -f "$STATE/before/absent-paths" ] && grep -qxF -- "$1" "$STATE/before/absent-paths"; }

kill_pids() {  # signal pids...: processes that are ours by construction (see the callers)
    local sig="$1" pid
    shift
    for pid in "$@"; do kill "-$sig" "$pid" 2>/dev/null || true; done
}

remove_kubepods_cgroups() {
    local h pids i
    [ -f "$STATE/before/cgroups-without-kubepods" ] || return 0
    while read -r h; do
        [ -d "$h/kubepods" ] || continue
        # Every process still in a kubepods group is a pod's: the group did not exist before our kubelet made it.
        for i in 1 2 3; do
            pids="$(find "$h/kubepods" -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u)"
            [ -n "$pids" ] || break
            # shellcheck disable=SC2086
            kill_pids KILL $pids
            sleep 0.5
        done
        # rmdir only removes empty groups; right after their last process exits the kernel may still say EBUSY.
        for i in $(seq 20); do
            find "$h/kubepods" -depth -type d -exec rmdir {} + 2>/dev/null || true
            [ -d "$h/kubepods" ] || break
            sleep 0.25
        done
        [ ! -d "$h/kubepods" ] || problem "cannot remove cgroup $h/kubepods"
    done <"$STATE/before/cgroups-without-kubepods"
}

restore_sysctls() {
    local name value path
    [ -f "$STATE/before/sysctls" ] || return 0
    while read -r name value; do
        path="/proc/sys/${name//.//}"
        [ "$(cat "$path" 2>/dev/null)" = "$value" ] && continue
        echo "$value" >"$path" 2>/dev/null || problem "cannot restore $name to $value"
        log "restored $name=$value"
    done <"$STATE/before/sysctls"
}

remove_created_paths() {
    local path
    for path in "${FIXED_PATHS[@]}"; do
        was_absent "$path" || continue
        [ -e "$path" ] || [ -L "$path" ] || continue
        unmount_under "$path"
        rm -rf --one-file-system "$path" || problem "cannot remove $path"
    done
}

remove_created_shared_dirs() {  # in order, deepest first; only if empty: another program may use them by now
    local path
    for path in "${SHARED_DIRS[@]}"; do
        if was_absent "$path" && [ -d "$path" ]; then rmdir "$path" 2>/dev/null || log "left $path: not empty"; fi
    done
}

cmd_down_locked() {
    [ -e "$STATE" ] || { log "not up (no $STATE): nothing to do"; return 0; }
    [ -f "$STATE/$MARKER" ] || die "$STATE is not a state folder of this script (no $MARKER in it): not touching it"
    local t0 name pids ids
    t0="$(now)"
    load_env 2>/dev/null || true
    # The kubelet first, so it does not restart the pods' containers we remove next.
    stop_recorded kubelet 20 || problem "cannot stop kubelet"
    # The pods' containers: every container of our dockerd is a pod's (ours, by construction).
    DOCKER="$( [ -x /usr/bin/docker ] && echo /usr/bin/docker || command -v docker || true)"
    if [ -n "$DOCKER" ] && recorded_alive dockerd >/dev/null; then
        ids="$(docker_ ps -aq 2>/dev/null || true)"
        # shellcheck disable=SC2086
        [ -z "$ids" ] || docker_ rm -f $ids >/dev/null 2>&1 || problem "docker rm -f of the pods' containers failed"
    fi
    stop_recorded dockerd 30 || problem "cannot stop dockerd"
    # Our dockerd's containerd and shims, should any outlive it.
    pids="$(runtime_pids_naming_state)"
    if [ -n "$pids" ]; then
        # shellcheck disable=SC2086
        kill_pids TERM $pids
        sleep 1
        pids="$(runtime_pids_naming_state)"
        # shellcheck disable=SC2086
        [ -z "$pids" ] || kill_pids KILL $pids
    fi
    for name in kube-scheduler kube-controller-manager kube-apiserver etcd; do
        stop_recorded "$name" 20 || problem "cannot stop $name"
    done
    # Unmount what the kubelet and dockerd mounted in the state folder (pods' volumes, the kubelet's and docker's
    # bind mounts of their own roots, docker's overlays).
    unmount_under "$STATE"
    remove_kubepods_cgroups
    restore_sysctls
    remove_created_paths
    # Last, as mount(8) and umount(8) create /run/mount (libmount's lock folder) when it is missing.
    remove_created_shared_dirs
    # Then the state folder, never crossing into another file system: a bind mount that would not go away cannot
    # lead rm into the host's files.
    if [ -n "$(mounts_under "$STATE")" ]; then
        problem "mounts remain under $STATE; it is left in place"
    elif [ ${#PROBLEMS[@]} -gt 0 ]; then
        problem "$STATE is left in place: it holds the records a second down needs"
    else
        rm -rf --one-file-system "$STATE" || problem "cannot remove $STATE"
    fi
    if [ ${#PROBLEMS[@]} -gt 0 ]; then
        log "down finished with ${#PROBLEMS[@]} problem(s):"
        printf '  %s\n' "${PROBLEMS[@]}" >&2
        return 1
    fi
    echo "down in $(elapsed "$t0") s"
}

cmd_down() {
    [ "$(id -u)" -eq 0 ] || die "needs root"
    [ -d "$(dirname "$STATE")" ] || { log "not up: nothing to do"; return 0; }
    exec 8<"$(dirname "$STATE")"
    flock -w 1800 8 || die "another up or down holds the lock on $(dirname "$STATE") for 30 minutes"
    cmd_down_locked
}

case "${1:-}" in
up) cmd_up ;;
down) cmd_down ;;
status) cmd_status ;;
env) cmd_env ;;
*)
    sed -n '3,10p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
