"""``python -m nbaccel env``: the environment report in a terminal."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(prog="nbaccel", description="PyTorch performance in Jupyter")
    parser.add_argument("--version", action="version", version=f"nbaccel {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="versions, device capabilities and precision flags")
    env.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    if args.command == "env":
        from .environment import env_report

        report = env_report()
        return _print(report.to_json(indent=2) if args.json else str(report))
    return 0


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
