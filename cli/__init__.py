"""The `rjob` command. Each command group lives in a private module that exposes `register(subparsers)`;
modules are imported only when their command runs, so `rjob plan` never pays for kopf or torch."""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys
from collections.abc import Sequence

# command -> (module, one-line help). A module's `register` adds the parser and sets `handler`.
COMMANDS: dict[str, tuple[str, str]] = {
    "profiles": ("resilientjob.cli._profiles", "list the built-in model profiles"),
    "templates": ("resilientjob.cli._templates", "generate Oobleck pipeline templates"),
    "detect": ("resilientjob.cli._failslow", "find fail-slow change points in an iteration-time trace"),
    "rebalance": ("resilientjob.cli._failslow", "optimal micro-batch split over data-parallel groups (S2)"),
    "profile": ("resilientjob.cli._profile", "measure a model's per-layer profile on this device"),
    "agent": ("resilientjob.cli._agent", "run the worker agent of one pod (what worker pods start)"),
    "operator": ("resilientjob.cli._operator", "run the ResilientJob operator (kopf)"),
    "local": ("resilientjob.cli._local", "the control plane on this machine (API server, Redis, operator)"),
    "simulate": ("resilientjob.cli._simulate", "simulate a training job under failures, per policy"),
    "plan": ("resilientjob.cli._plan", "plan a layout, or a recovery after node failures"),
    "demo": ("resilientjob.cli._demo", "the local demo: real training through a worker kill and a slowdown"),
    "chaos": ("resilientjob.cli._chaos", "inject fail-slows and failures into a running job"),
    "export": ("resilientjob.cli._export", "write a job's checkpoint as a Hugging Face model"),
}


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad flags already; keep its message to one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"rjob: error: {message}\n")


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = _Parser(prog="rjob", description="ResilientJob: resilient distributed training on Kubernetes.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    # A module that serves several commands registers all of them once; the others get placeholders so
    # `rjob --help` lists everything without importing every module.
    selected = COMMANDS[command][0] if command in COMMANDS else None
    if selected is not None:
        importlib.import_module(selected).register(subparsers)
    for name, (module_name, help_text) in COMMANDS.items():
        if module_name != selected:
            subparsers.add_parser(name, help=help_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in args_list if not arg.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    # Commands that hand their flags on to another program (`rjob agent`) take what argparse does not know.
    args, extra = parser.parse_known_args(args_list)
    if extra:
        if not getattr(args, "passthrough", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.flags = [*getattr(args, "flags", []), *extra]
    handler = getattr(args, "handler", None)
    args.option_flags = _option_flags(parser, getattr(args, "command", None))
    if handler is None:
        parser.print_help()
        return 0 if command is None else 2
    try:
        result: int = handler(args)
    except BrokenPipeError:
        if not _stdout_gone():
            raise  # a socket or a child's pipe broke: a real failure, not a reader that left
        # The reader went away (`rjob local get | head`): as a Unix tool, stop quietly. Standard output is
        # pointed at /dev/null so that the interpreter's own flush at exit does not fail the same way.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it
    return result


def _option_flags(parser: argparse.ArgumentParser, command: str | None) -> dict[str, str]:
    """dest -> its long flag, of `command`'s options and of the subcommand it ran (`rjob local chaos slow`):
    an error that names a field the user set by a flag names the flag (`_common.guarded`)."""
    flags: dict[str, str] = {}
    pending = [parser]
    while pending:
        current = pending.pop()
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
            elif action.option_strings and action.dest not in flags:
                flags[action.dest] = max(action.option_strings, key=len)
    return flags


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (poll reports an error on its end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no poll (Windows), or no file behind stdout
        return False


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
