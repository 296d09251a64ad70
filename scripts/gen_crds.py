#!/usr/bin/env python3
"""Write the ResilientJob CRD generated from the API models (operator/api.py) into crds/, and the Helm chart's
copy of it (charts/resilientjob/templates/crd-resilientjob.yaml: the same object, guarded by
`crds.install`, labelled by the chart and kept on uninstall when `crds.keep` is set).

Run after changing the API: `.venv/bin/python scripts/gen_crds.py`. `--check` exits 1 when a committed file
differs from the generator's output (what the drift tests assert).
"""

from __future__ import annotations

import sys
from pathlib import Path

from resilientjob.operator import api
from resilientjob.operator.crd import CRD_FILE, crd_yaml

ROOT = Path(__file__).resolve().parent.parent
CHART_CRD_FILE = "charts/resilientjob/templates/crd-resilientjob.yaml"

_CHART_METADATA = """\
  labels:
    {{- include "resilientjob.labels" . | nindent 4 }}
  {{- if .Values.crds.keep }}
  annotations:
    # Deleting the CRD would delete every ResilientJob in the cluster with it.
    helm.sh/resource-policy: keep
  {{- end }}
"""


def chart_crd_yaml() -> str:
    """The chart template: the generated CRD with the chart's labels, keep policy and install guard."""
    text = crd_yaml()
    if "{{" in text:
        # Helm would read any `{{` in a description or CEL rule as a template action.
        raise ValueError("the CRD contains '{{': escape it before templating the chart copy")
    name_line = f"  name: {api.PLURAL}.{api.GROUP}\n"
    if name_line not in text:
        raise ValueError(f"the CRD's metadata has no line {name_line!r}")
    body = text.replace(name_line, name_line + _CHART_METADATA, 1)
    header, _, manifest = body.partition("\n")
    return (
        "{{- if .Values.crds.install }}\n"
        f"{header.replace('Do not edit', 'Chart copy of ' + CRD_FILE + '; do not edit')}\n"
        f"{manifest}"
        "{{- end }}\n"
    )


def outputs() -> dict[str, str]:
    """Every generated file (path relative to the repository root) and its content."""
    return {CRD_FILE: crd_yaml(), CHART_CRD_FILE: chart_crd_yaml()}


def main(argv: list[str]) -> int:
    generated = outputs()
    if "--check" in argv:
        stale = [
            path
            for path, text in generated.items()
            if not (ROOT / path).exists() or (ROOT / path).read_text() != text
        ]
        for path in stale:
            print(f"{path} is stale: run scripts/gen_crds.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in generated.items():
        target = ROOT / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
