"""Activations and gradients between pipeline neighbours, sent so that NCCL and HCCL match them as gloo does.

The schedule (`_runtime_schedule.build_ops`) is deadlock-free when a receive matches its send by tag, which
gloo does. NCCL and HCCL do not:
- **They ignore tags.** A receive takes the next message its peer sent on that communicator. A heterogeneous
  rerouted plan has a node send micro-batches 0, 1, 4, 5, 2, 3 to a peer whose schedule receives them as
  0 to 5: micro-batch 4's activations would land in micro-batch 2's buffer (same shape, no error, wrong
  gradients). So each rank posts its receives from a peer in the order that peer sends (`send_order`, from
  the peer's op list), ahead of need when the schedule needs a later message first; the early ones wait.
- **A send holds its stream until the peer posts the receive.** ProcessGroupNCCL runs all the messages
  between two ranks of a group on one stream. In 1F1B, stage 0 sends activations 0 and 1 and then receives
  gradient 0, while stage 1 receives activation 0, sends gradient 0, then receives activation 1: each
  stream waits on a send whose receive is queued behind the other's send, for any activation larger than
  NCCL's buffers. So messages from a lower rank to a higher one travel on one process group and the other
  way on another (`directional_groups`): each pair's stream then carries one direction only, where the
  sender's order is the receiver's.

Both rules hold on every backend, so the CPU tests run the same path; `tagged=False` drops the tags as NCCL
does (the tests' proof that the order alone is right). `tests/agent/test_runtime_p2p.py` runs every
schedule through a model of NCCL's streams.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._runtime_schedule import Op

Send = Callable[..., Any]
"""`dist.isend(tensor, dst=, group=, tag=)`, or a model of it in tests."""


def send_order(ops: Mapping[int, Sequence[Op]], receiver: int) -> dict[int, list[int]]:
    """For each node that sends to `receiver`, the tags of its messages in the order it sends them: the
    order of its ops (a forward sends after it runs, a backward after its gradient is ready)."""
    order: dict[int, list[int]] = {}
    for sender, sender_ops in ops.items():
        if sender == receiver:
            continue  # a node's messages to itself go through the runtime's mailbox
        for op in sender_ops:
            if op.sends and op.send_to == receiver:
                order.setdefault(sender, []).append(op.send_tag)
    return order


def directional_groups(world_size: int, timeout_s: float) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Two groups of the whole world: messages to a higher rank go on the first, to a lower on the second.
    Every rank must call it, in the same order."""
    ranks = list(range(world_size))
    up = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
    down = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
    return up, down


@dataclass(slots=True)
class PeerChannels:
    """One rank's messages to and from its pipeline neighbours for one plan (`rank_of`: node -> its rank
    for this worker's lane). Call `start_step` before each step's first message."""

    node: int
    rank_of: Mapping[int, int]
    expected: dict[int, list[int]]
    """`send_order` for this node: sender -> tags in the order that sender sends them."""
    groups: tuple[Any, Any]
    """(to a higher rank, to a lower rank): `directional_groups`."""
    device: torch.device | str = "cpu"
    tagged: bool = True
    """Pass tags (gloo matches by them); False matches in order alone, as NCCL and HCCL do."""
    isend: Send | None = None
    """A model of `dist.isend` in tests; None: `dist.isend` looked up at each send. A function taken at
    import would be the one from before `tracing.install()`: the tracer would never see the pipeline's
    messages, so their waits (bubbles, a slow neighbour stage) would count as this node's compute and a
    chaos link order would never delay them."""
    irecv: Send | None = None
    """As `isend`, for `dist.irecv`."""
    _queues: dict[int, deque[int]] = field(default_factory=dict)
    _posted: dict[tuple[int, int], tuple[torch.Tensor, Any]] = field(default_factory=dict)

    def start_step(self) -> None:
        """A new step: every sender's messages come again in the same order (what an abandoned step left
        posted is the caller's to retire: `outstanding`)."""
        self._posted.clear()
        self._queues = {sender: deque(tags) for sender, tags in self.expected.items()}

    def finish_step(self) -> None:
        """The step ran to its end: every message received was used (else the schedules disagree)."""
        if self._posted:
            raise RuntimeError(
                f"p2p: node {self.node} received messages it never used: {sorted(self._posted)}"
            )

    def outstanding(self) -> list[Any]:
        """Work items of receives posted and not yet used (a failed step's, to retire with its groups)."""
        return [work for _, work in self._posted.values()]

    def _group(self, sender: int, receiver: int) -> Any:
        return self.groups[0] if self.rank_of[sender] < self.rank_of[receiver] else self.groups[1]

    def send(self, tensor: torch.Tensor, receiver: int, tag: int) -> Any:
        """Post the message to `receiver` (a node other than this one); returns its work item."""
        group = self._group(self.node, receiver)
        isend = self.isend or dist.isend
        return isend(tensor, dst=self.rank_of[receiver], group=group, tag=tag if self.tagged else 0)

    def recv(self, shape: Sequence[int], sender: int, tag: int) -> tuple[torch.Tensor, Any]:
        """The buffer and work item of the message `tag` from `sender`, with every message that sender
        sends before it posted first (their buffers wait here for the ops that need them)."""
        queue = self._queues.get(sender)
        irecv = self.irecv or dist.irecv
        while (sender, tag) not in self._posted:
            if not queue:
                raise RuntimeError(f"p2p: node {sender} sends no message {tag} to node {self.node} this step")
            next_tag = queue.popleft()
            buffer = torch.empty(tuple(shape), dtype=torch.float32, device=self.device)
            work = irecv(
                buffer,
                src=self.rank_of[sender],
                group=self._group(sender, self.node),
                tag=next_tag if self.tagged else 0,
            )
            self._posted[(sender, next_tag)] = (buffer, work)
        return self._posted.pop((sender, tag))
