"""The local API server's cost per pod: kmock's plain KubernetesEmulator against our LocalApiServer
(localstack/emulator.py) in one run, creating N pods over HTTP the way the operator and the process kubelet
touch them (create, status patch, get; 16 requests in flight).

    .venv/bin/python bench/bench_emulator.py [--pods 256 1024 4096] [--plain-max 256]

kmock records every request and routes each new one by filtering that record, and answers single-object
requests by scanning every object, so the plain emulator is O(N^2); ours forgets answered requests and looks
objects up by key. The plain emulator runs only up to --plain-max pods (it needs minutes beyond).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp
import kmock

from resilientjob.localstack._local_api_discovery import VERBS
from resilientjob.localstack.emulator import CORE_RESOURCES, LocalApiServer

MERGE_PATCH = {"content-type": "application/merge-patch+json"}


def _plain() -> kmock.KubernetesEmulator:
    emulator = kmock.KubernetesEmulator()
    for group, version, plural, kind, namespaced in CORE_RESOURCES:
        subresources = {"status"} if kind == "Pod" else set()
        resource = f"{group}/{version}/{plural}" if group else f"{version}/{plural}"
        emulator.resources[resource] = kmock.ResourceInfo(
            kind=kind,
            singular=kind.lower(),
            namespaced=namespaced,
            verbs=set(VERBS),
            subresources=subresources,
        )
    return emulator


async def create_pods(emulator: kmock.KubernetesEmulator, count: int) -> float:
    async with emulator, kmock.Server(emulator) as server, aiohttp.ClientSession() as session:
        url = f"{str(server.url).rstrip('/')}/api/v1/namespaces/default/pods"
        in_flight = asyncio.Semaphore(16)

        async def one(index: int) -> None:
            body = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"p{index}", "namespace": "default"},
            }
            async with in_flight:
                async with session.post(url, json=body) as response:
                    response.raise_for_status()
                status = {"status": {"phase": "Running"}}
                async with session.patch(
                    f"{url}/p{index}/status", json=status, headers=MERGE_PATCH
                ) as response:
                    response.raise_for_status()
                async with session.get(f"{url}/p{index}") as response:
                    response.raise_for_status()

        began = time.perf_counter()
        await asyncio.gather(*(one(index) for index in range(count)))
        return time.perf_counter() - began


async def main(args: argparse.Namespace) -> None:
    print(f"{'pods':>6} {'kmock emulator':>15} {'LocalApiServer':>15} {'speed-up':>9}")
    for count in args.pods:
        ours = await create_pods(LocalApiServer(), count)
        plain = await create_pods(_plain(), count) if count <= args.plain_max else None
        plain_text = f"{plain:14.2f}s" if plain is not None else f"{'(skipped)':>15}"
        ratio = f"{plain / ours:8.0f}x" if plain is not None else f"{'':>9}"
        print(f"{count:>6} {plain_text} {ours:14.2f}s {ratio}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--plain-max", type=int, default=256)
    asyncio.run(main(parser.parse_args()))
