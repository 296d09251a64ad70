"""`rjob local apply` (and `rjob demo`) read manifest files: every way a file can be wrong ends in one line
naming the file, the document and the field, exit 2, never a traceback; nothing is sent before every
document of the file is known to be well-formed (no stack runs here: the file is refused first)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _support import rjob_local

CASES = [
    (
        "syntax.yaml",
        "kind: ResilientJob\nmetadata: {name: a\n",
        ["invalid YAML at line 3, column 1", "flow mapping"],
    ),
    (
        "list.yaml",
        "- apiVersion: v1\n  kind: ConfigMap\n",
        ["document 1", "expected an object", "got a list"],
    ),
    ("scalar.yaml", "just words\n", ["document 1", "got a str"]),
    ("nokind.yaml", "apiVersion: v1\nmetadata: {name: a}\n", ["document 1", "kind: required"]),
    (
        "noname.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {}\n",
        ["document 1", "metadata.name: required"],
    ),
    (
        "second.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n---\napiVersion: v1\nkind: Deployment\n"
        "metadata: {name: b}\n",
        ["document 2 (deployment/b)", "kind: 'Deployment' is not supported"],
    ),
    (
        "version.yaml",
        "apiVersion: resilientjob.io/v9\nkind: ResilientJob\nmetadata: {name: a}\nspec: {}\n",
        ["document 1 (resilientjob/a)", "apiVersion: 'resilientjob.io/v9' is not served"],
    ),
    ("empty.yaml", "---\n", ["no objects in the file"]),
    (
        "twice.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\nkind: Secret\n",
        ["invalid YAML at line 4, column 1", "key 'kind' is given twice"],
    ),
]


@pytest.mark.parametrize(("name", "text", "expected"), CASES, ids=[case[0] for case in CASES])
def test_a_bad_manifest_file_is_one_line_naming_where(
    tmp_path: Path, name: str, text: str, expected: list[str]
) -> None:
    path = tmp_path / name
    path.write_text(text)
    done = rjob_local(tmp_path / "state", "apply", "-f", str(path))
    assert done.returncode == 2, done.stdout + done.stderr
    line = done.stderr.strip()
    assert "\n" not in line and "Traceback" not in line and str(path) in line, line
    for part in expected:
        assert part in line, line


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    done = rjob_local(tmp_path / "state", "apply", "-f", str(tmp_path / "nope.yaml"))
    assert done.returncode == 2 and "filename: cannot read" in done.stderr and "\n" not in done.stderr.strip()
