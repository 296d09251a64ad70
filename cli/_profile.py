"""`rjob profile`: measure a ModelProfile (per-layer time and memory) on this device and write it as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ._common import CliError, emit, guarded


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("profile", help="measure a model's per-layer profile on this device")
    parser.add_argument("model", help="gpt, llama, sleep, or module:function returning the ordered layers")
    parser.add_argument("--layers", type=int, default=8, help="built-ins: embedding + blocks + head")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, npu ...")
    parser.add_argument("--out", type=Path, help="write the profile here (default: print it)")
    parser.add_argument("--json", action="store_true", help="machine-readable summary")
    parser.set_defaults(handler=guarded(_run))


def _run(args: argparse.Namespace) -> int:
    # torch is imported only when this command runs, so `rjob plan` stays light.
    from resilientjob.agent.models import load_model
    from resilientjob.agent.profiler import measure_profile

    try:
        if ":" in args.model:
            spec = load_model(args.model, vocab=args.vocab, seq_len=args.seq_len)
        else:
            spec = load_model(
                args.model,
                layers=args.layers,
                hidden=args.hidden,
                heads=args.heads,
                vocab=args.vocab,
                seq_len=args.seq_len,
            )
        profile = measure_profile(spec, args.microbatch_size, args.repeats, args.device)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    document = profile.model_dump(mode="json")
    if args.out is None:
        print(json.dumps(document, indent=2))
        return 0
    args.out.write_text(json.dumps(document, indent=2))
    emit(
        {
            "profile": str(args.out),
            "layers": profile.num_layers,
            "step_s": sum(profile.stage_times(0, profile.num_layers)),
        },
        args.json,
        lambda p: f"wrote {p['profile']}: {p['layers']} layers, {p['step_s'] * 1e3:.2f} ms per micro-batch",
    )
    return 0
