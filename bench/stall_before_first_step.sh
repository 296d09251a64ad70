#!/usr/bin/env bash
# A worker stalls between the first plan and the first step (its heartbeat expires, then it is back), on the
# local stack: does the job replan and train on? Stops worker NODE's processes (SIGSTOP) for STOP_S seconds
# as soon as the first plan is published, then prints the job's generation, step and layout every 5 s.
#
#   STOP_S=5 NODE=2 WATCH=12 bash bench/stall_before_first_step.sh [MANIFEST]   (default: examples/demo.yaml)
set -u
cd "$(dirname "$0")/.."
manifest=${1:-examples/demo.yaml}
node=${NODE:-2}
dir=${RJOB_LOCAL_DIR:-/tmp/rjob-stall}
rjob=${RJOB:-.venv/bin/rjob}
kubectl=${KUBECTL:-build/tools/kubectl}
job=$(sed -n 's/^  name: //p' "$manifest" | head -1)
RJOB_LOCAL_DIR=$dir "$rjob" local down > /dev/null 2>&1
RJOB_LOCAL_DIR=$dir "$rjob" local up > /dev/null || exit 1
trap 'RJOB_LOCAL_DIR=$dir "$rjob" local down > /dev/null 2>&1' EXIT
export KUBECONFIG=$dir/kubeconfig
"$kubectl" apply -f "$manifest"
status() { "$kubectl" get resilientjob "$job" -o jsonpath="$1" 2> /dev/null; }
for _ in $(seq 1 600); do
    [ "$(status '{.status.planGeneration}')" = 0 ] && break
    sleep 0.1
done
echo "first plan $(status '{.status.layout}') at step $(status '{.status.step}')"
pids=$(for pid in $(pgrep -f resilientjob.agent); do
    tr '\0' '\n' < "/proc/$pid/environ" 2> /dev/null | grep -qx "POD_NAME=$job-node-$node" && echo "$pid"
done)
pids="$pids $(for pid in $pids; do pgrep -P "$pid"; done)"
[ -n "${pids// /}" ] || { echo "no processes found for $job-node-$node"; exit 1; }
kill -STOP $pids
sleep "${STOP_S:-5}"
kill -CONT $pids 2> /dev/null
echo "worker $node stopped for ${STOP_S:-5} s"
for _ in $(seq 1 "${WATCH:-12}"); do
    sleep 5
    echo "$(date +%T) $(status '{.status.phase} generation {.status.planGeneration} step {.status.step} {.status.layout} workers {.status.workers}')"
done
