"""``python -m nbaccel env``: the environment report in a terminal."""

from __future__ import annotations

import argparse
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
        print(report.to_json(indent=2) if args.json else str(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
