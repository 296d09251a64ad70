"""Credentials that rotate: the local API server requires a bearer token read from a file (as a
service-account token the kubelet rewrites) and the token changes while a job runs. Every client the
operator holds (kopf's, and its own for pods, config maps and status) logs in again on 401, reading the
file anew, so the job's next failure is still handled."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import kopf
import pytest
from _rjob_stack import NAMESPACE, Kube, Operator, api_server, emulator_only, eventually, job_manifest

from resilientjob.operator.kube import KubeApi, KubeError

pytestmark = [pytest.mark.cluster, emulator_only("the local API server's token file is the test's lever")]


def connection(url: str, token_file: Path) -> kopf.ConnectionInfo:
    token = token_file.read_text().strip()
    return kopf.ConnectionInfo(server=url, scheme="Bearer", token=token, default_namespace=NAMESPACE)


async def test_rotated_token_leads_to_a_fresh_login_and_the_job_is_still_handled(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(secrets.token_hex(16))
    async with api_server(token_file=token_file) as (_, url):
        stale = KubeApi(connection(url, token_file))  # no relogin: keeps its first token
        kube = Kube(connection(url, token_file))
        kube.api = KubeApi(connection(url, token_file), relogin=lambda: connection(url, token_file))
        monkeypatch.setenv("RJOB_API_TOKEN_FILE", str(token_file))
        operator = Operator(url, redis_url, tmp_path / "operator.log")
        operator.start()
        try:
            anonymous = KubeApi(kopf.ConnectionInfo(server=url))
            with pytest.raises(KubeError) as refused:
                await anonymous.list(kube.path("pods"))
            assert refused.value.status == 401
            await anonymous.close()
            assert await kube.create_job(job_manifest("rotate")) is None

            async def generation(number: int) -> dict[str, Any] | None:
                status = await kube.job_status("rotate")
                return status if status.get("planGeneration") == number else None

            await eventually(lambda: generation(0), 20, "generation 0")
            token_file.write_text(secrets.token_hex(16))  # rotated: the old token is refused from now on
            with pytest.raises(KubeError) as refused:
                await stale.get(kube.path("pods", "rotate-node-0"))
            assert refused.value.status == 401
            await kube.delete("pods", "rotate-node-2")
            status = await eventually(lambda: generation(1), 20, "generation 1 after the rotation")
            assert status["failedNodes"] == [2]
            # The operator's own writes went through with the new token: the replacement plan reached the
            # surviving pods' annotations.
            pods = await kube.job_pods("rotate")
            assert {p["metadata"]["annotations"]["resilientjob.io/generation"] for p in pods} == {"1"}
            log = (tmp_path / "operator.log").read_text()
            assert "HTTP 401" not in log
        finally:
            operator.stop()
            await kube.close()
            await stale.close()
