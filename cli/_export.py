"""`rjob export`: a job's checkpoint written as a Hugging Face model (`from_pretrained` loads it).

The trained model of a job that ended without writing it (it failed, or had no `spec.output`), or of any
step its checkpoint directory kept. Reads the weights only; a layer saved in tensor-parallel shards (a job
with several devices per stage) is merged, with no process group."""

from __future__ import annotations

import argparse
from pathlib import Path

from ._common import CliError, emit, guarded


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a job's checkpoint as a Hugging Face model (the trained model, or any kept step)",
    )
    parser.add_argument("checkpoint", type=Path, help="the job's spec.checkpoint.path (as mounted here)")
    parser.add_argument(
        "--model", required=True, help="the job's spec.model: hf:<dir> or hf:<family>?key=value&..."
    )
    parser.add_argument("--out", type=Path, required=True, help="the directory to write the model into")
    parser.add_argument(
        "--step", type=int, default=None, help="the step to write (default: the newest complete)"
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="the job's spec.data.tokenizer (a directory or its tokenizer.json): written with the model when "
        "the model's own directory has none, as the job's export does",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable summary")
    parser.set_defaults(handler=guarded(_run))


def _run(args: argparse.Namespace) -> int:
    # torch is imported only when this command runs, so `rjob plan` stays light.
    from resilientjob.agent.hf_export import write_from_checkpoint
    from resilientjob.agent.models import load_model

    if args.step is not None and args.step < 1:
        raise CliError(f"step: must be >= 1, got {args.step}")
    try:
        spec = load_model(args.model, seq_len=1)  # the weights do not depend on it
        step = write_from_checkpoint(spec, args.checkpoint, args.step, args.out, tokenizer=args.tokenizer)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"out: {args.out}: {exc.strerror or type(exc).__name__}") from None
    summary = {"model": args.model, "step": step, "layers": spec.num_layers, "out": str(args.out)}
    emit(
        summary,
        args.json,
        lambda s: f"wrote step {s['step']} of {s['model']} ({s['layers']} layers) to {s['out']}",
    )
    return 0
