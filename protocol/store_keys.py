"""The keys of a job's TCPStore: what the store host, the workers, the launcher and the demo read and write.

The store host (in a cluster; the launcher on one machine) hosts the store and mirrors the operator's plans
into it; every worker of the job uses it for the rendezvous, the plan of each generation, failure notices,
commit votes and the records the benchmarks and the demo read back. Part of `resilientjob.protocol`: standard
library only.

  generation            newest plan generation (integer)
  plan/<g>              Plan JSON of generation g
  failures              failures announced so far (counter; a wait abandons its step when it grows)
  accounted/<g>         the failure count plan g was computed with
  abandoned/<g>         ranks of plan g that abandoned a step (counter; a wait of g abandons its step too)
  applied/<g>           count of workers that finished switching to g
  loss/<step>           "<g>:<loss>" written by world rank 0 at each commit
  committed             committed steps so far
  samples/<step>        "<g>:<ids>;" appended by every node that computed losses in that step, as it votes
  received/<g>          "<layer>,<src>,<dst>,<bytes>;" appended by receivers of the transfer plan
  event/...             timestamps of failures, aborts and resumes (for the recovery benchmark)
  steptime/<g>          seconds of each committed step under plan g (for the throughput benchmarks)
  checkin/<g>           workers that checked in for the rendezvous of plan g
  arriving/<g>          ranks that reached the process-group rendezvous of plan g (a joiner enters last)
  joining/<node>        set by a joining node once it can rendezvous
  commit/<g>/<s>/<r>    rank r's commit vote for step s of generation g
  validation/request    the validation request the store host mirrored, with its boundary step (JSON)
  validation/result/<i> the ValidationResult of request i, left by world rank 0
  exported/<i>          the node that wrote layer i of the trained model (i = -1: its metadata)
  export/<node>/<r>     the layers a node's first device writes in round r ("done": the model is whole)
"""

from __future__ import annotations

GENERATION_KEY = "generation"
"""Store counter: the newest published plan generation."""

FAILURES_KEY = "failures"
"""Store counter: failures seen so far in the job (only ever incremented)."""

COMMITTED_KEY = "committed"
"""Committed steps so far, updated by world rank 0 after each committed step (`worker.worker_main`)."""

VALIDATION_REQUEST_KEY = "validation/request"
"""The validation request the store host mirrored, with its boundary step (JSON)."""


def plan_key(generation: int) -> str:
    """The Plan JSON of `generation`."""
    return f"plan/{generation}"


def accounted_key(generation: int) -> str:
    """The failure count the plan of `generation` was computed with."""
    return f"accounted/{generation}"


def abandoned_key(generation: int) -> str:
    """Counter of the ranks of `generation` that abandoned a step: one is enough to break its world."""
    return f"abandoned/{generation}"


def applied_key(generation: int) -> str:
    """Counter of the workers that finished switching to `generation`."""
    return f"applied/{generation}"


def loss_key(step: int) -> str:
    """ "<generation>:<loss>" of a committed step."""
    return f"loss/{step}"


def samples_key(step: int) -> str:
    """ "<generation>:<ids>;" appended by every node that computed losses in `step`, just before its commit
    vote (`agent._runtime_commit`)."""
    return f"samples/{step}"


def trained_samples(record: str) -> list[int]:
    """The sample ids a `samples/<step>` record says the step was trained on: the entries of its newest
    generation (an abandoned step's entries are superseded by the generation that trained it again)."""
    entries = [entry.split(":", 1) for entry in record.split(";") if entry]
    if not entries:
        return []
    newest = max(int(generation) for generation, _ in entries)
    return [int(i) for generation, ids in entries if int(generation) == newest for i in ids.split(",")]


def received_key(generation: int) -> str:
    """ "<layer>,<src>,<dst>,<bytes>;" appended by the receivers of the transfer plan of `generation`."""
    return f"received/{generation}"


def steptime_key(generation: int) -> str:
    """Seconds of each committed step under the plan of `generation`, ';'-separated."""
    return f"steptime/{generation}"


def checkin_key(generation: int) -> str:
    """Counter of the workers that checked in for the rendezvous of `generation`."""
    return f"checkin/{generation}"


def restored_key(generation: int) -> str:
    """Counter of the workers that loaded the checkpoint for the restart of `generation`."""
    return f"restored/{generation}"


def arriving_key(generation: int) -> str:
    """Counter of the ranks that reached the process-group rendezvous of `generation`."""
    return f"arriving/{generation}"


def joining_key(node: int) -> str:
    """Set by a joining node's workers once they can rendezvous (model loaded): plans that take the node in
    are published to the store only then (the store host, the launcher), so that its peers do not wait for
    it in a rendezvous that would time out while it starts."""
    return f"joining/{node}"


def vote_key(generation: int, step: int, rank: int) -> str:
    """Rank `rank`'s commit vote for `step` of `generation`."""
    return f"commit/{generation}/{step}/{rank}"


def event_key(kind: str, generation: int, node: int) -> str:
    """Timestamp of a node's `kind` event ("applied", "abort", "resumed") in `generation`."""
    return f"event/{kind}/{generation}/{node}"


def fail_event_key(node: int) -> str:
    """Timestamp of a node's failure."""
    return f"event/fail/{node}"


def validation_result_key(request_id: int) -> str:
    """Where world rank 0 leaves the pass's `ValidationResult`."""
    return f"validation/result/{request_id}"


def exported_key(item: int) -> str:
    """The node that wrote item `item` of the trained model: layer `item`, or -1 for config.json and the
    shard index (`agent._final_export`)."""
    return f"exported/{item}"


def export_round_key(node: int, round_: int) -> str:
    """JSON list of the items `node`'s first device writes in export round `round_`, for its other devices
    to gather with it; "done" once the model is whole."""
    return f"export/{node}/{round_}"


def export_ack_key(node: int, local_rank: int) -> str:
    """Set by device `local_rank` of `node` once it read that node's "done" round (`export_round_key`)."""
    return f"export/{node}/ack/{local_rank}"
