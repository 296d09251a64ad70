"""`GET pods/NAME/log` of the local API server: what the process kubelet captured of a pod's output (its
`log`, and the time each line started in `log.times`, `kubelet.capture_log`), with the options kubectl
sends: `tailLines` (`--tail`), `limitBytes` (`--limit-bytes`), `timestamps` (`--timestamps`: each line
prefixed with its RFC 3339 time, nanoseconds, as the kubelet writes them), `sinceSeconds` / `sinceTime`
(`--since`, `--since-time`: the lines that started then or later) and `follow` (`-f`: new lines as they
come, until the pod has ended or is gone)."""

from __future__ import annotations

import asyncio
import bisect
import datetime
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ._local_api_admission import refuse
from .kubelet import LOG_TIMES

POLL_S = 0.2
"""How often a follow looks for new output."""


@dataclass(frozen=True, slots=True)
class LogOptions:
    tail: int | None = None
    limit_bytes: int | None = None
    timestamps: bool = False
    since: float | None = None
    """Unix time: only lines that started then or later."""
    follow: bool = False

    @classmethod
    def of(cls, params: Mapping[str, str], now: float) -> LogOptions:
        """The options of a request's query; 400 naming the parameter for a value kube-apiserver refuses."""

        def count(name: str) -> int | None:
            raw = params.get(name)
            if raw is None or raw == "":
                return None
            if not raw.isdigit():
                raise refuse(400, "BadRequest", f"{name}: {raw!r} is not a non-negative integer")
            return int(raw)

        since = None
        seconds = count("sinceSeconds")
        if seconds is not None:
            if seconds < 1:
                raise refuse(400, "BadRequest", "sinceSeconds: must be greater than 0")
            since = now - seconds
        if params.get("sinceTime"):
            if since is not None:
                raise refuse(400, "BadRequest", "at most one of sinceTime or sinceSeconds may be specified")
            try:
                moment = datetime.datetime.fromisoformat(params["sinceTime"].replace("Z", "+00:00"))
            except ValueError:
                raise refuse(
                    400, "BadRequest", f"sinceTime: {params['sinceTime']!r} is not RFC 3339"
                ) from None
            since = (moment if moment.tzinfo else moment.replace(tzinfo=datetime.UTC)).timestamp()
        return cls(
            tail=count("tailLines"),
            limit_bytes=count("limitBytes"),
            timestamps=params.get("timestamps") in ("true", "1"),
            since=since,
            follow=params.get("follow") in ("true", "1"),
        )


def stamp(at: float) -> str:
    """RFC 3339 with nanoseconds in UTC, as a kubelet's log lines carry it."""
    moment = datetime.datetime.fromtimestamp(at, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond:06d}000Z"


def _starts(times_path: Path) -> tuple[list[int], list[float]]:
    offsets: list[int] = []
    moments: list[float] = []
    if times_path.exists():
        for entry in times_path.read_text(errors="replace").splitlines():
            offset, _, at = entry.partition(" ")
            if offset.isdigit() and at:
                try:
                    moments.append(float(at))
                except ValueError:
                    continue
                offsets.append(int(offset))
    return offsets, moments


def read_lines(log: Path, start: int = 0, whole_only: bool = False) -> tuple[list[tuple[float, bytes]], int]:
    """The lines of `log` from byte `start`, each with the time it started (that of the line before when
    the kubelet noted none: a log from before times were kept, or a line cut at `LOG_LINE_LIMIT`), and the
    offset after them. `whole_only`: a last line without its end stays for later (a follow)."""
    if not log.exists():
        return [], start
    with log.open("rb") as file:
        file.seek(start)
        data = file.read()
    offsets, moments = _starts(log.parent / LOG_TIMES)
    lines: list[tuple[float, bytes]] = []
    position = start
    for line in data.splitlines(keepends=True):
        if whole_only and not line.endswith(b"\n"):
            break
        index = bisect.bisect_right(offsets, position) - 1
        lines.append((moments[index] if index >= 0 else 0.0, line))
        position += len(line)
    return lines, position


def render(lines: list[tuple[float, bytes]], options: LogOptions) -> bytes:
    """The lines as the response's body: those since `since`, the last `tail` of them, each with its time
    when asked, at most `limit_bytes` (as kube-apiserver, it counts the whole response)."""
    if options.since is not None:
        lines = [(at, line) for at, line in lines if at >= options.since]
    if options.tail is not None:
        lines = lines[len(lines) - options.tail :] if options.tail else []
    body = b"".join((stamp(at).encode() + b" " + line) if options.timestamps else line for at, line in lines)
    return body if options.limit_bytes is None else body[: options.limit_bytes]


async def follow(
    log: Path,
    start: int,
    options: LogOptions,
    write: Callable[[bytes], Awaitable[None]],
    ended: Callable[[], bool],
    left_bytes: int | None = None,
) -> None:
    """Write the lines `log` gains after byte `start` as they come (whole lines, with their times when
    asked), until `ended()` says the pod is done or gone and nothing new is left, or `left_bytes` (what
    `limitBytes` leaves after the lines sent first) are sent."""
    offset = start
    while left_bytes is None or left_bytes > 0:
        done = ended()  # read before the file: a line written just before the end is not lost
        lines, offset = read_lines(log, offset, whole_only=not done)
        if lines:
            body = render(lines, LogOptions(timestamps=options.timestamps, limit_bytes=left_bytes))
            if left_bytes is not None:
                left_bytes -= len(body)
            await write(body)
        elif done:
            return
        await asyncio.sleep(POLL_S)
