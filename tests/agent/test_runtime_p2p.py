"""Pipeline messages as NCCL and HCCL match them (`agent/_runtime_p2p.py`).

NCCL cannot run here, so its matching is modelled (`_NcclStreams`): the messages between two ranks of a
group run in one stream per rank, in the order posted; a send and a receive complete together once both
are at their streams' heads, whatever their tags. Every schedule is run through it as the runtime runs a
step (blocking receives, non-blocking sends waited at the end); each message carries its true tag, and the
receiver checks it got the one its op asked for. Two controls show the model catches both faults the
module guards against: both directions on one group deadlocks 1F1B, and receives posted in the receiver's
own order mix up a heterogeneous rerouted plan's micro-batches.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilientjob.agent._runtime_p2p import PeerChannels, send_order
from resilientjob.agent._runtime_schedule import Op, OpKind, build_ops, world_nodes
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan


@dataclass(slots=True)
class _Message:
    receive: bool
    tensor: torch.Tensor
    done: bool = False


@dataclass(slots=True)
class _NcclStreams:
    """Per (group, rank, peer), the operations posted, executed in order; tags ignored."""

    queues: dict[tuple[Any, int, int], deque[_Message]] = field(default_factory=lambda: defaultdict(deque))
    events: int = 0
    """Posts and matches so far: a round of every rank that adds none is a deadlock."""

    def isend(self, rank: int) -> Callable[..., _Message]:
        def post(tensor: torch.Tensor, dst: int, group: Any, tag: int) -> _Message:
            message = _Message(False, tensor.clone())
            self.events += 1
            self.queues[(group, rank, dst)].append(message)
            return message

        return post

    def irecv(self, rank: int) -> Callable[..., _Message]:
        def post(buffer: torch.Tensor, src: int, group: Any, tag: int) -> _Message:
            message = _Message(True, buffer)
            self.events += 1
            self.queues[(group, rank, src)].append(message)
            return message

        return post

    def progress(self) -> None:
        for (group, rank, peer), queue in list(self.queues.items()):
            other = self.queues.get((group, peer, rank))
            while queue and other and not queue[0].receive and other[0].receive:
                send, receive = queue.popleft(), other.popleft()
                receive.tensor.copy_(send.tensor)
                send.done = receive.done = True
                self.events += 1


def _program(node: int, ops: list[Op], channels: PeerChannels) -> Iterator[None]:
    """One rank's step as `Trainer._run_step` runs it: receive (blocking), compute, send (non-blocking)."""
    channels.start_step()
    mailbox: dict[int, float] = {}
    sends: list[_Message] = []
    for op in ops:
        if op.receives:
            if op.recv_from == node:
                got = mailbox.pop(op.tag)
            else:
                buffer, work = channels.recv((1,), op.recv_from, op.tag)
                while not work.done:
                    yield
                got = buffer.item()
            assert got == op.tag, f"node {node} wanted message {op.tag} from {op.recv_from}, got {got:.0f}"
        if op.sends:
            if op.send_to == node:
                mailbox[op.send_tag] = float(op.send_tag)
            else:
                sends.append(channels.send(torch.tensor([float(op.send_tag)]), op.send_to, op.send_tag))
    while not all(message.done for message in sends):
        yield
    channels.finish_step()


def _run(plan: Plan, groups: tuple[Any, Any] = ("up", "down"), own_order: bool = False) -> bool:
    """Run one step of every node through the model; False on a deadlock. `own_order`: each receiver
    posts in its own schedule's order instead of its senders' (the runtime before `_runtime_p2p`)."""
    schedule = build_ops(plan)
    rank_of = {node: rank for rank, node in enumerate(world_nodes(plan))}
    streams = _NcclStreams()
    programs = {}
    for node, ops in schedule.items():
        expected = send_order(schedule, node)
        if own_order:
            expected = defaultdict(list)
            for op in ops:
                if op.receives and op.recv_from != node:
                    expected[op.recv_from].append(op.tag)
        channels = PeerChannels(
            node,
            rank_of,
            dict(expected),
            groups,
            tagged=False,
            isend=streams.isend(rank_of[node]),
            irecv=streams.irecv(rank_of[node]),
        )
        programs[node] = _program(node, ops, channels)
    while programs:
        before = (streams.events, len(programs))
        for node in list(programs):
            try:
                next(programs[node])
            except StopIteration:
                del programs[node]
        streams.progress()
        if (streams.events, len(programs)) == before:
            return False  # every rank is blocked and no message can move
    return True


def _stage(start: int, end: int, node: int, rerouted_to: tuple[int, ...] = ()) -> StagePlan:
    return StagePlan(layers=(start, end), node=node, rerouted_to=rerouted_to)


def _pipeline(bounds: list[int], first_node: int, microbatches: int) -> PipelinePlan:
    stages = tuple(_stage(bounds[i], bounds[i + 1], first_node + i) for i in range(len(bounds) - 1))
    return PipelinePlan(stages=stages, microbatches=microbatches)


def _plan(*pipelines: PipelinePlan) -> Plan:
    return Plan(policy=Policy.REROUTE, microbatch_size=1, step_time_s=1.0, pipelines=pipelines)


HETEROGENEOUS_REROUTED = _plan(
    PipelinePlan(stages=(_stage(0, 4, 0), _stage(4, 8, 1)), microbatches=4),
    PipelinePlan(stages=(_stage(0, 3, 2), _stage(3, 6, 3, (0, 1)), _stage(6, 8, 4)), microbatches=4),
)
"""Node 3 failed; its layers 3-6 run on nodes 0 and 1, whose own stages split the layers at 4 instead."""

PLANS = {
    "1F1B 2 stages": _plan(_pipeline([0, 4, 8], 0, 4)),
    "1F1B 4 stages": _plan(_pipeline([0, 2, 4, 6, 8], 0, 8)),
    "DP2 x PP3": _plan(_pipeline([0, 3, 6, 8], 0, 5), _pipeline([0, 3, 6, 8], 3, 5)),
    "rerouted middle stage": _plan(
        _pipeline([0, 2, 4, 6], 0, 4),
        PipelinePlan(stages=(_stage(0, 2, 3), _stage(2, 4, 4, (1,)), _stage(4, 6, 5)), microbatches=4),
    ),
    "heterogeneous rerouted": HETEROGENEOUS_REROUTED,
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_schedule_completes_on_nccl_streams_with_each_message_where_its_tag_says(name: str) -> None:
    assert _run(PLANS[name])


def test_both_directions_on_one_group_deadlock_1f1b_on_nccl_streams() -> None:
    # The control: the runtime before `_runtime_p2p` sent everything on the default group.
    assert not _run(PLANS["1F1B 2 stages"], groups=("world", "world"))


def test_receives_in_the_receivers_own_order_mix_up_micro_batches_without_tags() -> None:
    # The control: node 0 sends node 1 its own micro-batches and the rerouted ones in another order than
    # node 1's schedule takes them.
    with pytest.raises(AssertionError, match="wanted message"):
        _run(HETEROGENEOUS_REROUTED, own_order=True)


def test_send_order_lists_each_senders_messages_as_its_ops_send_them() -> None:
    schedule = build_ops(PLANS["1F1B 2 stages"])
    to_last = send_order(schedule, 1)
    assert list(to_last) == [0]
    assert to_last[0] == [op.send_tag for op in schedule[0] if op.kind == OpKind.FORWARD]
    assert send_order(schedule, 0)[1] == [op.send_tag for op in schedule[1] if op.kind == OpKind.BACKWARD]


def test_a_receive_no_sender_sends_is_an_error_not_a_hang() -> None:
    channels = PeerChannels(1, {0: 0, 1: 1}, {0: [7]}, ("up", "down"), isend=None, irecv=lambda *a, **k: None)
    channels.start_step()
    with pytest.raises(RuntimeError, match="node 0 sends no message 9 to node 1"):
        channels.recv((1,), 0, 9)


def test_messages_go_through_the_torch_distributed_functions_of_the_call_so_the_tracer_sees_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tracer replaces `dist.isend`/`dist.irecv` after the runtime's modules are imported: channels made
    before or after must call the functions of the moment. (A function taken at import left the pipeline's
    messages untraced: their waits counted as compute, and a slow link's chaos never delayed them.)"""
    channels = PeerChannels(0, {0: 0, 1: 1}, {1: [3]}, ("up", "down"))
    sent: list[dict[str, Any]] = []
    posted: list[dict[str, Any]] = []
    monkeypatch.setattr(dist, "isend", lambda *_, **kw: sent.append(kw) or "send-work")
    monkeypatch.setattr(dist, "irecv", lambda *_, **kw: posted.append(kw) or "recv-work")
    channels.start_step()
    assert channels.send(torch.zeros(2), 1, 5) == "send-work"
    _, work = channels.recv((2,), 1, 3)
    assert work == "recv-work"
    assert (sent[0]["dst"], sent[0]["tag"], posted[0]["src"], posted[0]["tag"]) == (1, 5, 1, 3)


@pytest.mark.torch
def test_a_heterogeneous_rerouted_plan_trains_as_the_reference_with_messages_matched_in_order(
    tmp_path: Path, job_config: Callable[..., Any]
) -> None:
    """Real gloo workers that ignore tags as NCCL does: the loss is the single-process run's."""
    from resilientjob.planner.profile import uniform_profile
    from resilientjob.testing.launcher import Launcher
    from resilientjob.testing.plans import RuntimePlanner
    from resilientjob.testing.reference import reference_run

    plan = HETEROGENEOUS_REROUTED.model_copy(update={"microbatch_size": 2})
    config = job_config(steps=2, p2p_in_order=True)
    reference, _, _ = reference_run(config, plan.global_batch, plan.microbatch_size)
    planner = RuntimePlanner.for_job(
        uniform_profile(8), nodes=5, global_batch=plan.global_batch, microbatch_size=2
    )
    result = Launcher(config, plan, planner, tmp_path).run(timeout_s=90)
    assert sorted(result.losses) == [0, 1]
    for step in range(2):
        assert result.losses[step] == pytest.approx(reference[step], rel=0.01), step
