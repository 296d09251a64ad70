"""`rjob profile`: measure a ModelProfile (per-layer time and memory) on this device and write it as JSON.

With `--computed`, a Hugging Face model's profile is computed from its config instead, as node 0 computes it
(FLOPs at `--device-flops` or the device's speed, exact bytes; `agent.profiler.computed_profile`): no layer
is built, so it works for any size."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ._common import CliError, emit, guarded

if TYPE_CHECKING:
    from resilientjob.planner.profile import ModelProfile


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("profile", help="measure a model's per-layer profile on this device")
    parser.add_argument(
        "model",
        help="gpt, llama, sleep, hf:<dir>, hf:<family>?key=value&..., a built-in profile name (llama2-7b, "
        "gpt3-2.7b, gpt3-6.7b), or module:function returning the ordered layers",
    )
    parser.add_argument("--layers", type=int, default=8, help="built-ins: embedding + blocks + head")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument(
        "--seq-len", type=int, default=None, help="default 16 (a built-in profile name: its own length)"
    )
    parser.add_argument("--microbatch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, npu ...")
    parser.add_argument(
        "--computed",
        action="store_true",
        help="Hugging Face models: compute the profile from the config (FLOPs, exact bytes), do not measure",
    )
    parser.add_argument(
        "--device-flops",
        type=float,
        default=None,
        help="--computed: the device's FLOP/s (default: for cpu, this CPU's timed fp32 matrix product, as "
        "node 0 prices it; for an accelerator 150e12)",
    )
    parser.add_argument(
        "--inline",
        action="store_true",
        help="write it as a manifest's spec.profile (YAML, camelCase: paste it under a ResilientJob's spec)",
    )
    parser.add_argument("--out", type=Path, help="write the profile here (default: print it)")
    parser.add_argument("--json", action="store_true", help="machine-readable summary")
    parser.set_defaults(handler=guarded(_run))


def _run(args: argparse.Namespace) -> int:
    # torch is imported only when this command runs, so `rjob plan` stays light.
    from resilientjob.agent.models import ModelKind, load_model
    from resilientjob.agent.profiler import check_device, computed_profile, measure_profile

    if args.device_flops is not None and not args.computed:
        raise CliError("device-flops: only with --computed (a measured profile times this device)")
    length = {} if args.seq_len is None else {"seq_len": args.seq_len}
    try:
        if not args.computed:
            check_device(args.device)  # before anything is built
        if args.model in {kind.value for kind in ModelKind}:
            spec = load_model(
                args.model,
                layers=args.layers,
                hidden=args.hidden,
                heads=args.heads,
                vocab=args.vocab,
                seq_len=args.seq_len or 16,
            )
        elif ":" in args.model and not args.model.startswith("hf:"):
            spec = load_model(args.model, vocab=args.vocab, seq_len=args.seq_len or 16)
        else:  # hf:<dir>, hf:<family>?..., or a built-in profile name
            spec = load_model(args.model, **length)
        if args.computed:
            if spec.hf is None:
                raise CliError(f"model: --computed needs a Hugging Face model, got {args.model}")
            device = args.device.split(":")[0]
            profile = computed_profile(
                args.model, spec.seq_len, args.microbatch_size, device, built=spec, flops=args.device_flops
            )
        else:
            if spec.hf is not None:  # a 7B model is minutes and GBs to build: say so before, on stderr
                print(
                    f"measuring {args.model}: builds and times each of its {spec.num_layers} layers on "
                    f"{args.device} (--computed answers from its configuration without building it)",
                    file=sys.stderr,
                    flush=True,
                )
            profile = measure_profile(spec, args.microbatch_size, args.repeats, args.device)
    except ValueError as exc:  # PlannerError included
        raise CliError(str(exc)) from None
    text = _inline(profile, args) if args.inline else json.dumps(profile.model_dump(mode="json"), indent=2)
    if args.out is None:
        print(text)
        return 0
    try:
        args.out.write_text(text)
    except OSError as exc:
        raise CliError(f"out: cannot write {args.out}: {exc.strerror or exc}") from None
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


def _inline(profile: ModelProfile, args: argparse.Namespace) -> str:
    """The profile as a ResilientJob's `spec.profile` block: the API's camelCase names (the planner's JSON,
    which `configMapRef` and `--profile` take, has Python's)."""
    import yaml

    from resilientjob.operator.api import LayerSpec

    layers = [
        LayerSpec.model_validate(layer.model_dump(mode="json")).model_dump(mode="json", by_alias=True)
        for layer in profile.layers
    ]
    made = f"rjob profile {args.model}" + (" --computed" if args.computed else f" on {args.device}")
    return f"# spec.profile of a ResilientJob ({made})\n" + yaml.safe_dump(
        {"profile": {"inline": layers}}, sort_keys=False
    )
