"""``python -m nbaccel``: the environment report and trace analysis in a terminal.

``env`` is what ``%nbaccel_env`` shows; ``trace PATH`` is what ``%profile_trace PATH`` shows, for a
trace on a cluster's login node or in CI where no notebook runs. Both are the plain API, printed.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    from . import __version__
    from .profile_options import FILTER_HELP

    parser = argparse.ArgumentParser(prog="nbaccel", description="PyTorch performance in Jupyter")
    parser.add_argument("--version", action="version", version=f"nbaccel {__version__}")
    sub = parser.add_subparsers(dest="command")
    env = sub.add_parser("env", help="versions, device capabilities and precision flags")
    env.add_argument("--json", action="store_true", help="print JSON instead of text")
    trace = sub.add_parser("trace", help="analyse a torch.profiler Chrome trace (what %%profile_trace shows)",
                           description="Analyse a torch.profiler Chrome trace file, or a folder of per-rank traces: "
                                       "the operator table, time by category, Tensor Core share, FLOP/s and advice.")
    trace.add_argument("path", metavar="PATH", help="a .json / .json.gz trace file, or a folder of them")
    trace.add_argument("--top", type=int, default=15, help="rows of the operator table (default 15)")
    trace.add_argument("--sort", default=None, help="cpu, self, device, calls, memory or flops "
                                                    "(default: device when the trace has kernels, else self)")
    trace.add_argument("--filter", default="", metavar="TEXT", help=FILTER_HELP)
    trace.add_argument("--shapes", action="store_true", help="group the table by op and input shapes")
    # as %profile_trace: "--sort memory needs --memory" named a flag this command lacked (a user trial)
    trace.add_argument("--stack", action="store_true",
                       help="group by recorded Python source (traces made with with_stack=True)")
    trace.add_argument("--memory", action="store_true",
                       help="charge recorded [memory] events to ops (traces made with profile_memory=True)")
    trace.add_argument("--rank", type=int, default=None, help="in a folder of several ranks, only this rank")
    trace.add_argument("--json", action="store_true", help="print the result's to_dict() as JSON")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # parse_args says "unrecognized arguments" with the top-level usage, which lists no trace option:
        # the subcommand's parser says it with its own, and names the option meant, as the magics do
        own = sub.choices.get(args.command) or parser
        own.error(f"unrecognized arguments: {' '.join(unknown)}{_did_you_mean(own, unknown)}")
    if args.command is None:  # `python -m nbaccel` alone: what there is, not "arguments are required"
        parser.print_help()
        return 0
    if args.command == "env":
        from .environment import env_report

        report = env_report()
        return _print(report.to_json(indent=2) if args.json else str(report))
    return _trace(args)


def _did_you_mean(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """" (did you mean --top?)" for the first mistyped option (a trial typed ``--tpo 3``); "" when none is close."""
    import difflib

    options = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    for token in unknown:
        if token.startswith("--"):
            close = difflib.get_close_matches(token.split("=")[0], options, n=1)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


def _trace(args) -> int:
    """Errors a user can fix (a wrong path, an option that cannot apply) are one line and status 2."""
    from .options import CLI_TRACE, magic_spelling
    from .profile_options import ProfileError
    from .trace_result import TraceError, load_trace, trace_warnings_said

    try:
        with magic_spelling(), trace_warnings_said(lambda message: print(f"nbaccel trace: {message}", file=sys.stderr)):
            result = load_trace(args.path, rank=args.rank, top=args.top, sort=args.sort, shapes=args.shapes,
                                stack=args.stack, memory=args.memory, filter=args.filter)
    except (TraceError, ProfileError) as exc:
        print(f"nbaccel trace: {exc}", file=sys.stderr)
        return 2
    result.made_by = CLI_TRACE  # "nbaccel trace: ..."; its advice spells options as this command line (--top)
    return _print(result.to_json(indent=2, default=str) if args.json else str(result))


def _print(text: str) -> int:
    """Print ``text``; 0, or 1 when the reader closed the pipe first (``nbaccel env | head -1``).

    A closed stdout is the reader's choice, not an error to show a traceback for. As the Python
    docs' "Note on SIGPIPE" advises, stdout is pointed at devnull so that the interpreter's own
    flush at exit cannot raise again, and the exit status is 1, as Python's own on EPIPE: the
    output was cut short.
    """
    try:
        print(text)
        sys.stdout.flush()  # a pipe is block-buffered: the write that fails is this flush
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
