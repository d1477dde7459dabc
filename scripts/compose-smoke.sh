#!/usr/bin/env bash
# `make compose-smoke`: docker-compose.yml's stack, in containers, trains the tiny example to its end.
#
# Builds the images (scripts/build-images.sh: cached, offline), runs `docker-compose up --exit-code-from trainer`
# under its own project name, then reads the run folder out of the `run` volume: every step must have a metrics row
# and the final model must be there. Prints the figures (wall time, steps, first and last reward) and removes the
# containers and volumes whatever happened. Where redis:7.0 is not in the daemon (no registry here), Redis is the
# image build-images.sh makes from Debian's redis-server.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROJECT="${REINFORCE_SMOKE_PROJECT:-reinforce-smoke}"
STEPS="$(sed -n 's/^  steps: \([0-9]*\)$/\1/p' "$ROOT/examples/compose.yaml")"
LOG="${TMPDIR:-/tmp}/$PROJECT.log"
TIMEOUT="${REINFORCE_SMOKE_TIMEOUT:-600}"  # seconds for `docker-compose up`; the tiny run takes under a minute

bash "$ROOT/scripts/build-images.sh"
docker image inspect redis:7.0 >/dev/null 2>&1 || export REINFORCE_REDIS_IMAGE="${REINFORCE_REDIS_IMAGE:-reinforce-redis:0.1.0}"

COMPOSE=(docker-compose --project-name "$PROJECT" --file "$ROOT/docker-compose.yml")
trap '"${COMPOSE[@]}" down --volumes >/dev/null 2>&1 || true' EXIT
"${COMPOSE[@]}" down --volumes >/dev/null 2>&1 || true  # what an interrupted smoke run left

start=$SECONDS
if ! timeout --signal=KILL "$TIMEOUT" "${COMPOSE[@]}" up --exit-code-from trainer >"$LOG" 2>&1 </dev/null; then
    tail -n 60 "$LOG" >&2
    # Each container's state and last health probes (KILL above left them running): what a stuck stack waits on.
    for id in $("${COMPOSE[@]}" ps --all --quiet 2>/dev/null); do
        docker inspect --format '{{.Name}} {{.State.Status}} exit={{.State.ExitCode}}{{if .State.Health}} health={{.State.Health.Status}}{{range .State.Health.Log}} [{{.ExitCode}}: {{.Output}}]{{end}}{{end}}' "$id" >&2 || true
    done
    echo "compose-smoke: the stack failed or did not finish in $TIMEOUT s; log $LOG" >&2
    exit 1
fi
elapsed=$((SECONDS - start))

# The run folder as the trainer left it, read from its volume by the runtime image's Python.
docker run --rm --interactive --network none --volume "${PROJECT}_run:/data:ro" reinforce-runtime:0.1.0 python - "$STEPS" "$elapsed" <<'EOF'
import sys
from pathlib import Path

from reinforce.core.metrics import read_metrics
from reinforce.core.run_dir import RunPaths

steps, elapsed = int(sys.argv[1]), int(sys.argv[2])
paths = RunPaths(Path("/data/run"))
rows = read_metrics(paths.metrics)
assert [row["step"] for row in rows] == list(range(1, steps + 1)), f"steps trained: {[row['step'] for row in rows]}"
assert (paths.final_model / "config.json").exists(), "no final model"
rewards = [row["train_rollouts/rewards"] for row in rows]
print(f"compose-smoke: {steps} steps in {elapsed} s (docker-compose up to the trainer's exit); "
      f"reward {rewards[0]:.3f} at step 1, {rewards[-1]:.3f} at step {steps}; final model written")
EOF
