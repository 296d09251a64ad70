#!/bin/sh
# The image's entry point: `agent` starts the worker agent (what the operator runs in worker pods),
# anything else is an `rjob` command line (`operator` by default). On Ascend images the CANN environment
# is loaded first so that torch_npu finds its libraries.
set -eu
for env_script in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/nnal/atb/set_env.sh; do
    if [ -f "$env_script" ]; then
        # The CANN scripts read variables that may be unset (LD_LIBRARY_PATH, ...).
        set +u
        # shellcheck disable=SC1090
        . "$env_script"
        set -u
    fi
done
if [ "${1:-}" = "agent" ]; then
    shift
    exec python3 -m resilientjob.agent "$@"
fi
exec rjob "$@"
