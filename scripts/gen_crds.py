#!/usr/bin/env python3
"""Write the ResilientJob CRD generated from the API models (operator/api.py) into crds/.

Run after changing the API: `.venv/bin/python scripts/gen_crds.py`. `--check` exits 1 when the committed file
differs from the generator's output (what the drift test asserts).
"""

from __future__ import annotations

import sys
from pathlib import Path

from resilientjob.operator.crd import CRD_FILE, crd_yaml

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    target = ROOT / CRD_FILE
    text = crd_yaml()
    if "--check" in argv:
        current = target.read_text() if target.exists() else ""
        if current != text:
            print(f"{CRD_FILE} is stale: run scripts/gen_crds.py", file=sys.stderr)
            return 1
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    print(f"wrote {CRD_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
