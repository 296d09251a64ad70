"""The small real-training job the local-stack bridge tests run: examples/demo.yaml cut to a few workers."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import redis
import yaml
from _support import rjob_ok, until

from resilientjob.protocol.keys import JobKeys

ROOT = Path(__file__).resolve().parents[2]


def apply_demo_job(
    stack: Path, directory: Path, name: str, nodes: int = 4, **spec: Any
) -> tuple[dict[str, Any], redis.Redis, JobKeys, Any]:
    """Apply the demo's GPT job as `name` on `nodes` workers, with whole steps per epoch (no step spans two
    epochs, where a sample may come twice) and fail-slow off (a noisy shared CPU must not add generations);
    `spec` overrides spec fields. Returns the manifest, a Redis client, the job's keys and a client of the
    job's rendezvous store (the store pod's address, as it registered it)."""
    from torch._C._distributed_c10d import TCPStore

    manifest = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    manifest["metadata"]["name"] = name
    manifest["spec"]["nodes"] = nodes
    manifest["spec"]["data"]["numSamples"] = 16 * manifest["spec"]["globalBatchSize"]
    manifest["spec"]["failSlow"]["enabled"] = False
    manifest["spec"].update(spec)
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    rjob_ok(stack, "apply", "-f", str(path))
    state = json.loads((stack / "state.json").read_text())
    client = redis.Redis.from_url(state["redis_url"])
    keys = JobKeys("default", name)
    address = until(lambda: client.get(keys.store), 30, "the store host").decode()
    host, _, port = address.rpartition(":")
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    return manifest, client, keys, store
