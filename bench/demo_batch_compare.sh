#!/usr/bin/env bash
# `rjob demo` with the demo job at different global batch sizes, side by side: the same micro-batches of 4,
# so more samples per step are more micro-batches per replica for S2 to move off the slowed worker. Runs
# alternate (48, 72, 48, 72, ...) so that the host's drift falls on both; each run measures its own healthy,
# slowed and mitigated throughput. Prints each run's layouts, S2's decision and the demo's closing line.
# FACTORS compares the slowed worker's factor the same way (`rjob demo --slow-factor`; default: the demo's).
#
#   BATCHES="48 72" ROUNDS=2 OUT=DIR bash bench/demo_batch_compare.sh     (about 3.2 min per run)
#   BATCHES=48 FACTORS="3 4" ROUNDS=3 bash bench/demo_batch_compare.sh
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/demo-batch-compare}
rjob=${RJOB:-.venv/bin/rjob}
mkdir -p "$out"
for round in $(seq 1 "${ROUNDS:-2}"); do
    for batch in ${BATCHES:-48 72}; do
      for factor in ${FACTORS:-default}; do
        name=$out/b$batch-x$factor-r$round
        sed "s/^  globalBatchSize: .*/  globalBatchSize: $batch/" examples/demo.yaml > "$name.yaml"
        rm -rf "$name"
        slow=()
        [ "$factor" = default ] || slow=(--slow-factor "$factor")
        RJOB_LOCAL_DIR="$out/stack" "$rjob" demo --no-live -f "$name.yaml" --out "$name" "${slow[@]}" > "$name.log" 2>&1
        echo "== global batch $batch, factor $factor, round $round (rc $?, load $(cut -d' ' -f1 /proc/loadavg))"
        grep -E "generation [01]:" "$name.log" | sed 's/^\[ *[0-9.]*s\] /  /'
        # The console wraps long lines at its width: join each with its continuation lines.
        awk '/^\[ *[0-9.]+s\] decision: |^fail-slow on worker/ {line = $0; joining = 1; next}
             joining && /^(\[|loss |wrote |$)/ {print line; joining = 0}
             joining {line = line " " $0}' "$name.log" | sed 's/^\[ *[0-9.]*s\] /  /'
      done
    done
done
