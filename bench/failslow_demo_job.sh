#!/usr/bin/env bash
# The fail-slow figures of the demo job (issue 15) in one run: compute 1.5x and 1.3x at threshold 1.2, the
# 5x congested link, `rjob demo` itself (x4, its own threshold), compute 2x at 1.5 and at 1.2,
# one after another, as long as BUDGET_S allows. Every run is the real stack (kmock API server, redis, the
# kopf operator, the process kubelet) and the demo's real GPT on 8 CPU workers (gloo), as on a laptop; each
# run measures its own healthy, slowed and mitigated throughput, so no figure compares two machines.
#
# Written for a quiet many-core host (the device machine's 16 cores: one core per worker, the control plane
# on the rest), where the 2-core host's 20-30% step noise is gone. On a 2-core host it runs too, slowly.
#
#   OUT=DIR BUDGET_S=500 bash bench/failslow_demo_job.sh
#   WHEELS=DIR ...   first installs the wheels in DIR under /tmp/site (a host whose python lacks our deps;
#                    bench/offline_bundle.sh packs them, and redis-server: PATH=$PWD/.dev/bin:$PATH WHEELS=.dev/whl)
#   RUNS="NAME ..."  these runs in this order (names in `run` below)
#   LIMIT_S=S        each bench run stopped after at most S seconds
#   DEMO_S=S         the demo's --duration (default 120, its own default)
#
# Writes DIR/summary.txt (a line per run), DIR/runs.tgz (each run's JSON, output and operator log) and
# DIR/demo.png.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/failslow-demo-job}
work=$(mktemp -d /tmp/failslow-demo-job.XXXX)
mkdir -p "$out"
deadline=$((SECONDS + ${BUDGET_S:-500}))
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

if [ -n "${WHEELS:-}" ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

log() { echo "[$(date -u +%T)] $*" | tee -a "$out/summary.txt"; }

log "host: $(nproc) cpus, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), load $(cut -d' ' -f1-3 /proc/loadavg)"
log "python $("$py" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)')"
"$py" -c 'import resilientjob.localstack.stack, kopf, kmock, celpy, redis, pydantic' || exit 1
redis-server --version >/dev/null || exit 1

pack() { tar -czf "$out/runs.tgz" -C "$work" --exclude='*.sock' --exclude='*.rdb' . 2>/dev/null; }

figures() {  # NAME: the run's headline figures from its JSON
    "$py" - "$work/$1.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    print("no result")
    raise SystemExit
keys = ("job_slowed_by", "detection_delay_iterations", "episode_delay_iterations", "mitigation_delay_iterations",
        "healthy_steps_per_s", "slow_steps_per_s", "mitigated_steps_per_s", "slowdown_removed",
        "step_time_slowdown_removed", "compute_factor_measured", "wall_s")
parts = [f"{k}={r[k]:.3g}" if isinstance(r.get(k), float) else f"{k}={r.get(k)}" for k in keys if k in r]
m = r.get("mitigation") or {}
print(" ".join(parts), f"strategy={m.get('strategy')}", f"layout={r.get('layout')}")
EOF
}

bench() {  # NAME LIMIT_S ARGS...: one bench_failslow_e2e run, stopped (SIGINT: the stack goes down) at LIMIT_S
    local name=$1 limit=$2 left
    shift 2
    ((limit > ${LIMIT_S:-$limit})) && limit=$LIMIT_S
    left=$((deadline - SECONDS))
    ((left < limit)) && limit=$left
    if ((limit < 40)); then
        log "$name: skipped, ${left}s left"
        return
    fi
    # A compute order under the job's threshold rightly opens no episode: the run gives up waiting for one
    # early enough (about a minute goes to the stack's start and the healthy phase) to report its figures.
    [[ " $* " == *" --scenario compute "* ]] && set -- "$@" --patience $((limit > 100 ? limit - 70 : 30))
    timeout -s INT -k 20 "$limit" "$py" bench/bench_failslow_e2e.py "$@" --workdir "$work/$name.stack" \
        --json "$work/$name.json" >"$work/$name.out" 2>&1
    local rc=$?
    RJOB_LOCAL_DIR="$work/$name.stack" "$py" -m resilientjob.cli local down >/dev/null 2>&1
    log "$name (rc $rc, $*): $(figures "$name")"
    find "$work/$name.stack" -type f -size +4M -delete  # a long run's pod logs: the JSON has the steps
    pack
}

demo_job() {  # `rjob demo` itself: the kill, then x4 on a worker, at the demo's threshold (1.5)
    local left=$((deadline - SECONDS)) duration=${DEMO_S:-120}
    if ((left < duration + 50)); then
        log "demo: skipped, ${left}s left"
        return
    fi
    COLUMNS=400 timeout -s INT -k 20 $((duration + 50)) "$py" -m resilientjob.cli demo --no-live --duration "$duration" \
        -f examples/demo.yaml --out "$work/demo" >"$work/demo.out" 2>&1
    # The fail-slow measurement runs over three lines: the detection, the mitigation, the share removed.
    log "demo (rc $?): $(grep -A2 -E '^fail-slow' "$work/demo.out" | tr '\n' ' ') $(grep -E '^(peer-to-peer|loss )' \
        "$work/demo.out" | tr '\n' ' ')"
    cp "$work/demo/demo.png" "$out/demo.png" 2>/dev/null
    find "$work/demo" -type f -size +4M -delete
    pack
}

run() {  # NAME: one of the runs below
    local demo=(--scenario compute --manifest examples/demo.yaml --slow-node 7)
    case $1 in
    compute-1.5x-t1.2 | compute-1.5x-t1.2-again) bench "$1" 150 "${demo[@]}" --factor 1.5 --threshold 1.2 ;;
    compute-1.3x-t1.2) bench "$1" 150 "${demo[@]}" --factor 1.3 --threshold 1.2 ;;
    compute-2x-t1.5) bench "$1" 150 "${demo[@]}" --factor 2 --threshold 1.5 ;;
    compute-2x-t1.2) bench "$1" 150 "${demo[@]}" --factor 2 --threshold 1.2 ;;
    link-5x) bench "$1" 200 --scenario link --manifest examples/demo.yaml ;;
    demo) demo_job ;;
    *) log "$1: no such run" ;;
    esac
}

# RUNS picks and orders them (a short lease: the most wanted first).
for name in ${RUNS:-compute-1.5x-t1.2 compute-1.3x-t1.2 link-5x demo compute-2x-t1.5 compute-2x-t1.2}; do
    run "$name"
done
log "done"
