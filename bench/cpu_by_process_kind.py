"""CPU seconds by process kind on this machine while something else runs (the test suite's CI, a demo).

Samples /proc every second: each process's CPU time as last seen, summed by kind (its command line) when
`--stop-file` appears. Start it before what it measures: a process already running counts its whole life.
A process that lives less than a second may be missed; kernel threads and processes first seen as zombies
have no command line (kind "unnamed", kernel threads with their whole life's CPU). The kinds are this
project's (warm-started pods share their warm interpreter's command line).

    python bench/cpu_by_process_kind.py --out /tmp/cpu.json &  bash .ci/run;  touch /tmp/cpu.stop
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path

KINDS = (
    ("localstack._warm_start", "warm interpreters and the pods they forked"),
    ("resilientjob.cli operator", "operators (cold)"),
    ("redis-server", "redis"),
    ("resilientjob.localstack", "local stacks"),
    ("multiprocessing.forkserver", "the launcher's forkserver workers"),
    ("exec(eval(sys.stdin", "pytest's parallel processes"),
    ("pytest", "pytest"),
    ("resilientjob.cli", "rjob commands"),
    ("bin/rjob", "rjob commands"),
    ("mypy", "mypy"),
    ("pip", "pip"),
)


def kind(command: str) -> str:
    for needle, name in KINDS:
        if needle in command:
            return name
    return command.split(" ", maxsplit=1)[0].rsplit("/", 1)[-1] or "unnamed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop-file", type=Path, default=Path("/tmp/cpu.stop"))
    args = parser.parse_args()
    ticks = os.sysconf("SC_CLK_TCK")
    seen: dict[tuple[str, str], tuple[str, float]] = {}
    while not args.stop_file.exists():
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
                cpu_s = (int(fields[11]) + int(fields[12])) / ticks
                key = (entry.name, fields[19])  # pid and start time: a reused pid is another process
                if key in seen:
                    seen[key] = (seen[key][0], cpu_s)
                else:
                    command = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ")
                    seen[key] = (kind(command.decode(errors="replace").strip()), cpu_s)
            except (OSError, IndexError, ValueError):
                continue  # exited while being read
        time.sleep(1.0)
    totals: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for name, cpu_s in seen.values():
        totals[name] += cpu_s
        counts[name] += 1
    report = {
        name: {"cpu_s": round(cpu_s, 1), "processes": counts[name]} for name, cpu_s in totals.most_common()
    }
    args.out.write_text(json.dumps(report, indent=1))
    for name, row in report.items():
        print(f"{row['cpu_s']:9.1f} CPU-s {row['processes']:6d} processes  {name}")


if __name__ == "__main__":
    main()
