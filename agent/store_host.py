"""The job's store host: `python -m resilientjob.agent.store_host`, the one process of the job's store pod
(`<job>-store`, which the operator creates next to the worker pods of a job that trains through the
runtime; `operator/_store.py`).

It hosts the job's one `TCPStore` (rendezvous, plans, failure counter, commit votes), mirrors every
generation the operator commits in Redis into it (`worker.publish_plan`; it watches the small generation key
and reads a plan once per generation), announces the nodes a generation
drops without parking them as failures (`worker.announce_failures`) before publishing it, so survivors
blocked behind a dead peer abandon their step at once, and relays validation (`_validation_relay`). Its
address (`$POD_IP:$RJOB_STORE_PORT`, port 29500 in a cluster, a free one in the local stack) is the Redis
key `<job prefix>store`, which the worker pods read (`RJOB_STORE_ADDR` overrides it).

Why a pod of its own: hosted inside a worker pod, the store died with that pod and took the whole job with
it. No worker pod is special now; the store pod holds no training state and runs no collectives, so it fails
far more rarely than a worker, and the operator re-creates it when it does (a new store starts from the
committed plan in Redis).

It keeps running while Redis is away (training goes on; the host retries with backoff and re-registers its
address in a Redis that came back empty) and stops on SIGTERM (the job's deletion deletes the pod), or
once the job trained all its steps and no worker has heartbeated for `DONE_IDLE_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from datetime import timedelta

import redis.asyncio as aioredis

from resilientjob.planner.plan import Plan
from resilientjob.protocol.keys import JobKeys
from resilientjob.protocol.messages import MAX_PLAN_BYTES, PlanAnnouncement, decode
from resilientjob.protocol.store_keys import COMMITTED_KEY, joining_key

from ._redis import REDIS_DOWN, Outage, connect
from .telemetry import SUPERSEDED_EXIT, Refusals

STORE_PORT_ENV = "RJOB_STORE_PORT"
"""The port the store listens on (0 or unset: any free port)."""

DONE_IDLE_S = 10.0
"""After the last step, the host stops once no worker has heartbeated for this long."""

REGISTER_EVERY_S = 1.0
"""The host checks its address key this often (and rewrites it into a Redis that came back empty)."""


def dropped_nodes(previous: Plan | None, announcement: PlanAnnouncement) -> set[int]:
    """Nodes the new generation drops that are not parked by fail-slow mitigation: they died (a parked
    node is alive and leaves its world cleanly at the next commit, so it is no failure)."""
    if previous is None:
        return set()
    return set(previous.nodes) - set(announcement.plan.nodes) - set(announcement.parked)


class StoreHost:
    """Hosts the job's TCPStore and mirrors the operator's generations into it."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: JobKeys,
        advertise: str,
        *,
        port: int = 0,
        steps: int | None = None,
        poll_s: float = 0.05,
        job_uid: str = "",
    ) -> None:
        from torch._C._distributed_c10d import TCPStore

        from ._validation_relay import ValidationRelay

        self.client = client
        self.keys = keys
        self.poll_s = poll_s
        self.steps = steps
        """The job's last step (`spec.training.steps`); None: run until stopped."""
        self.store = TCPStore(
            advertise, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
        self.address = f"{advertise}:{self.store.port}"
        self.plan: Plan | None = None
        self.parked: list[int] = []
        self.announced = 0
        self.job_uid = job_uid
        """The uid of the ResilientJob this host serves (RJOB_JOB_UID); "": never superseded."""
        self.superseded = False
        """The job's keys belong to another job of this name: this host's job was deleted."""
        self.refusals = Refusals()
        """Since when the owner key names another job (the operator sets it back within a pass when a
        reloaded Redis named a deleted job: the host waits the agents' grace before it stops)."""
        self.seeded = False
        """Whether the failure counter was taken over from an earlier host (`JobKeys.store_failures`)."""
        self.validation = ValidationRelay(client, keys, self.store)
        self.outage = Outage("store host")
        self._held = -1
        """The generation last held back for joining nodes (told once in the log)."""
        self._fetched: PlanAnnouncement | None = None
        """The last announcement read from Redis (`_newer` reads each generation's plan once)."""

    async def _newer(self) -> PlanAnnouncement | None:
        """The committed announcement when it is newer than the store's plan. A poll reads only the small
        generation key (`JobKeys.plan_generation`, which the operator sets with the plan in one transaction);
        the plan itself, hundreds of kilobytes at thousands of nodes, only once that number has moved past
        the store's, and once per generation while a generation waits for joining nodes. Without a readable
        generation key it reads the plan, as it did before there was one."""
        raw = await self.client.get(self.keys.plan_generation)
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else ""
        generation = int(text) if text.isdigit() else None
        mirrored = self.plan.generation if self.plan is not None else -1
        if generation is not None and generation <= mirrored:
            return None
        fetched = self._fetched
        if generation is None or fetched is None or fetched.generation != generation:
            raw_plan = await self.client.get(self.keys.plan)
            fetched = self._fetched = decode(PlanAnnouncement, raw_plan, "bridge.plan", MAX_PLAN_BYTES)
        return fetched if fetched is not None and fetched.generation > mirrored else None

    def unready(self, announcement: PlanAnnouncement) -> list[int]:
        """Nodes new to the store's world whose workers cannot rendezvous yet: replacement pods joining, and
        parked nodes coming back (their worker left when they were parked, and a new one starts when the
        node is taken back, `_parked`). The generation waits for them (`store_keys.joining_key`), and the
        workers keep training meanwhile. A new host (no plan yet) waits for nobody."""
        from ._runtime_schedule import world_nodes

        if self.plan is None:
            return []
        new = set(world_nodes(announcement.plan)) - set(world_nodes(self.plan))
        return sorted(node for node in new if not self.store.check([joining_key(node)]))

    def _due(self, current: PlanAnnouncement) -> bool:
        """Whether to mirror `current` now: newer than the store's plan, and no joining node to wait for."""
        if self.plan is not None and current.generation <= self.plan.generation:
            return False
        waiting = self.unready(current)
        if waiting and self._held != current.generation:
            self._held = current.generation
            print(f"store host: generation {current.generation} waits for nodes {waiting}", flush=True)
        return not waiting

    def mirror(self, announcement: PlanAnnouncement) -> None:
        """Announce the generation's dead nodes, then publish its plan (in that order: see module doc)."""
        from .worker import announce_failures, publish_plan

        dead = dropped_nodes(self.plan, announcement)
        if dead:
            self.announced = announce_failures(self.store, len(dead))
        publish_plan(self.store, announcement.plan, self.announced)
        for node in set(announcement.parked) - set(self.parked):
            # A parked node's worker leaves; the one that starts when the node is taken back says anew
            # when it can rendezvous.
            self.store.delete_key(joining_key(node))
        self.plan, self.parked = announcement.plan, list(announcement.parked)
        print(
            f"store host: generation {announcement.generation} {announcement.layout} "
            f"({announcement.trigger or 'initial'}; dead {sorted(dead)})",
            flush=True,
        )

    async def _seed(self) -> None:
        """Take the failure count over from the host this one replaces (none: a new job, count 0)."""
        from .worker import announce_failures

        raw = await self.client.get(self.keys.store_failures)
        text = raw.decode() if isinstance(raw, bytes) else str(raw or "")
        count = int(text) if text.isdigit() else 0
        if count:
            self.announced = announce_failures(self.store, count)
            print(f"store host: taking over from an earlier host ({count} failures announced)", flush=True)
        self.seeded = True

    async def _anyone_alive(self) -> bool:
        nodes = set(self.plan.nodes if self.plan else ()) | set(self.parked)
        if not nodes:
            return True
        return bool(await self.client.exists(*(self.keys.heartbeat(node) for node in sorted(nodes))))

    async def _owned_by_another(self) -> bool:
        """Whether the operator gave the job's keys to a newer job of this name (`JobRedis.claim`). Checked
        before every registration: a host left behind by a deleted job (its pod stuck terminating on a node
        cut off from the API server) would otherwise keep pointing the new job's workers at its store."""
        if not self.job_uid:
            return False
        owner = await self.client.get(self.keys.owner)
        return owner is not None and owner != self.job_uid.encode()

    async def _superseded(self) -> bool:
        """Whether this host's job was deleted: the keys have named another job for the agents' grace
        (`Refusals`; until then the host only stops registering). Says so once it stops."""
        if not self.refusals.note(not await self._owned_by_another()):
            return False
        print(
            f"store host: the Redis keys of job {self.keys.namespace}/{self.keys.job} belong to another "
            f"ResilientJob of that name; this pod's job (uid {self.job_uid}) was deleted: it stops",
            flush=True,
        )
        self.superseded = True
        return True

    def _trained(self) -> bool:
        if self.steps is None or not self.store.check([COMMITTED_KEY]):
            return False
        return int(self.store.get(COMMITTED_KEY)) >= self.steps

    async def run(self, stopped: asyncio.Event) -> None:
        """Mirror generations until `stopped` or the job is done (see the module doc). Redis away stops
        nothing: the host keeps serving the store, retries with backoff, and once Redis is back re-registers
        its address if the key is gone; time without Redis does not count as workers gone."""
        alive_at = time.monotonic()
        registered_at = 0.0
        while not stopped.is_set():
            wait_s = self.poll_s
            try:
                if not self.seeded:
                    await self._seed()
                current = await self._newer()
                if current is not None and self._due(current):
                    before = self.announced
                    self.mirror(current)
                    if self.announced != before:
                        await self.client.set(self.keys.store_failures, self.announced)
                await self.validation.poll(self.plan.generation if self.plan is not None else None)
                if self.plan is not None and time.monotonic() - registered_at > REGISTER_EVERY_S:
                    if await self._superseded():
                        return
                    # The address appears only once a plan is in the store: workers read it at once (and
                    # workers of a replaced host reconnect only once the plan is back). Rewritten into a
                    # Redis that came back empty, with the failure count; never into another job's keys.
                    if (
                        self.refusals.since is None
                        and await self.client.get(self.keys.store) != self.address.encode()
                    ):
                        await self.client.set(self.keys.store_failures, self.announced)
                        await self.client.set(self.keys.store, self.address)
                    registered_at = time.monotonic()
                alive = await self._anyone_alive()
                self.outage.ok()
            except REDIS_DOWN as exc:
                wait_s = self.outage.failed(exc)
                alive_at = time.monotonic()
            else:
                if alive or not self._trained():
                    alive_at = time.monotonic()
                elif time.monotonic() - alive_at > DONE_IDLE_S:
                    print(f"store host: trained to step {self.steps}, no worker left; stopping", flush=True)
                    return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), wait_s)


def _steps(env: dict[str, str]) -> int | None:
    from resilientjob.protocol.workload import WORKLOAD_ENV, load_workload

    return load_workload(env[WORKLOAD_ENV]).training.steps if env.get(WORKLOAD_ENV) else None


async def host_main() -> int:
    env = dict(os.environ)
    try:
        keys = JobKeys(env.get("RJOB_NAMESPACE", "default"), env["RJOB_JOB"])
        url = env["RJOB_REDIS_URL"]
        port = int(env.get(STORE_PORT_ENV) or 0)
        steps = _steps(env)
    except (KeyError, ValueError) as exc:
        print(f"resilientjob.agent.store_host: missing or bad environment: {exc}", file=sys.stderr)
        return 2
    client = connect(url, env.get("RJOB_REDIS_PASSWORD"))
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopped.set)
    host = StoreHost(
        client,
        keys,
        env.get("POD_IP") or "127.0.0.1",
        port=port,
        steps=steps,
        job_uid=env.get("RJOB_JOB_UID", ""),
    )
    print(f"store host: job {keys.namespace}/{keys.job} store at {host.address}", flush=True)
    try:
        await host.run(stopped)
    finally:
        with contextlib.suppress(*REDIS_DOWN):
            # Only our own address: the host that replaces this one must not lose its key.
            if not host.superseded and await client.get(keys.store) == host.address.encode():
                await client.delete(keys.store)
        with contextlib.suppress(Exception):
            await client.aclose()
    return SUPERSEDED_EXIT if host.superseded else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(host_main()))
