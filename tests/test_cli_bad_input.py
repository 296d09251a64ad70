"""Bad input to `rjob` commands ends in one line on stderr naming the field, exit 2, never a traceback: the
cases a new user's first session found printing tracebacks (2026-12-08)."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import pytest

from resilientjob.cli import main


def _one_line(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rjob: error: ") and "\n" not in err, err
    return err.removeprefix("rjob: error: ")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["gpt", "--device", "banana"], "--device: expected cpu, cuda[:N] or npu[:N], got 'banana'"),
        (["gpt", "--device", "cuda:99"], "--device: cuda:99: this "),  # no CUDA here, or not 100 devices
        pytest.param(
            ["gpt", "--device", "npu"],
            "--device: npu needs torch_npu",
            marks=pytest.mark.skipif(find_spec("torch_npu") is not None, reason="torch_npu is installed"),
        ),
        (["hf:llama?num_hidden_layers=abc", "--computed"], "model: hf:llama: TypeError: Field 'num_hidden"),
        (["os:path"], "model: 'os:path' is a module, not a function"),  # a positional: no flag
        (["llama2-7b", "--computed", "--seq-len", "0"], "--seq-len: must be >= 1, got 0"),  # not seq_len
    ],
)
def test_rjob_profile(capsys: pytest.CaptureFixture[str], args: list[str], said: str) -> None:
    assert _one_line(capsys, ["profile", *args]).startswith(said)


def test_rjob_profile_into_a_missing_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "missing" / "p.json"
    args = ["profile", "gpt", "--layers", "3", "--repeats", "1", "--out", str(out)]
    assert _one_line(capsys, args) == f"--out: cannot write {out}: No such file or directory"


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--metrics-port", "-1"], {}, "--metrics-port: must be 0..65535, got -1"),
        (["--health-port", "99999"], {}, "--health-port: must be 0..65535, got 99999"),
        ([], {"RJOB_METRICS_PORT": "abc"}, "RJOB_METRICS_PORT: expected an integer, got 'abc'"),
        (
            ["--kubeconfig", "/nonexistent/kubeconfig"],
            {},
            "--kubeconfig: no such file: /nonexistent/kubeconfig",
        ),
        ([], {"KUBECONFIG": "/nonexistent/a:/nonexistent/b"}, "KUBECONFIG: no such file: /nonexistent/a:"),
        ([], {}, "no cluster to log in to: no in-cluster service account, no --kubeconfig"),
    ],
)
def test_rjob_operator_that_cannot_start(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    args: list[str],
    env: dict[str, str],
    said: str,
) -> None:
    """Refused before kopf starts: a LoginError was a traceback, then a retry each minute, forever."""
    for name in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "RJOB_API_URL", "RJOB_KUBECONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _one_line(capsys, ["operator", *args]).startswith(said)


def test_rjob_local_up_and_demo_where_a_file_is(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    monkeypatch.setenv("RJOB_LOCAL_DIR", str(taken))
    said = f"cannot make the folder {taken}: a file is there"
    assert _one_line(capsys, ["local", "up"]) == f"RJOB_LOCAL_DIR: {said}"
    assert _one_line(capsys, ["demo", "--out", str(taken)]) == f"--out: {said}"
    assert taken.read_text() == "mine"


@pytest.mark.parametrize("times", ["1,,2", "1,2,", ","])
def test_rjob_rebalance_refuses_an_empty_group(capsys: pytest.CaptureFixture[str], times: str) -> None:
    """`1,,2` was read as two groups, not three."""
    said = _one_line(capsys, ["rebalance", "--times", times, "--microbatches", "4"])
    assert said == f"--times: expected comma-separated numbers, got {times!r}"


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        ("  nodes: 8\n", '  nodes: "8"\n', "spec.nodes: Input should be a valid integer"),
        ("  nodes: 8\n", "  nodez: 8\n", "spec.nodez: unknown field"),
        ("forwardS", "forward_s", "spec.profile.inline.0.forward_s: unknown field"),
    ],
)
def test_rjob_plan_takes_a_manifest_as_the_api_server_does(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, old: str, new: str, said: str
) -> None:
    """`kubectl apply` refuses these (a string for an integer, the Python names of camelCase fields, an
    unknown field); `rjob plan -f` planned the first two, and named the third's missing `spec.nodes`."""
    demo = (Path(__file__).resolve().parent.parent / "examples" / "demo.yaml").read_text()
    assert old in demo
    manifest = tmp_path / "job.yaml"
    manifest.write_text(demo.replace(old, new))
    assert _one_line(capsys, ["plan", "-f", str(manifest)]).endswith(f"(resilientjob/demo-gpt): {said}")


def test_rjob_profile_inline_is_a_block_a_manifest_takes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`rjob profile --out` writes the planner's JSON (Python names), which `spec.profile.inline` refuses
    (camelCase names): `--inline` writes the block a manifest takes, and the job plans with it."""
    import yaml

    assert main(["profile", "gpt", "--layers", "3", "--repeats", "1", "--inline"]) == 0
    block = yaml.safe_load(capsys.readouterr().out)
    assert [layer["name"] for layer in block["profile"]["inline"]][:2] == ["embedding0", "gptblock1"]
    assert {"forwardS", "paramBytes"} <= set(block["profile"]["inline"][0])
    demo = yaml.safe_load((Path(__file__).resolve().parent.parent / "examples" / "demo.yaml").read_text())
    demo["spec"] = {**demo["spec"], **block}
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(demo))
    assert main(["plan", "-f", str(manifest), "--json"]) == 0
    assert "spec.profile.inline (3 layers)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        ("p.yaml", "layers:\n  - forward_s: 1\n bad: [\n", "is not valid YAML at line 3, column 2: expected"),
        ("p.json", '{"layers":', "is not valid JSON: Expecting value"),
        ("", "", "is no file and no built-in profile (bert-large, gpt3-2.7b"),
    ],
)
def test_rjob_templates_with_a_bad_profile(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, text: str, said: str
) -> None:
    """A malformed YAML profile printed PyYAML's seven-line report; a name that is neither a file nor a
    built-in profile said only that the file could not be read."""
    path = tmp_path / (name or "llama-typo")
    if name:
        path.write_text(text)
    assert _one_line(capsys, ["templates", "--profile", str(path), "--nodes", "4"]).startswith(
        f"--profile: '{path}' {said}"
    )


def test_rjob_chaos_with_a_missing_kubeconfig_says_which(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """It said only "no cluster configuration found", not that the file it was given is not there."""
    monkeypatch.delenv("RJOB_KUBECONFIG", raising=False)
    missing = str(tmp_path / "kubeconfig")
    monkeypatch.setenv("KUBECONFIG", missing)
    assert _one_line(capsys, ["chaos", "kill", "pod-0"]) == f"KUBECONFIG: no such file: {missing}"
    said = _one_line(capsys, ["chaos", "kill", "pod-0", "--kubeconfig", missing + "2"])
    assert said == f"--kubeconfig: no such file: {missing}2"
