"""``python -m torch_tpu env [--markdown]``: the environment variables torch_tpu
reads, with the values in force (``--markdown``: README's table)."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_tpu")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="list the environment variables with the values in force")
    env.add_argument("--markdown", action="store_true", help="print README's table instead")
    args = parser.parse_args(argv)
    from . import _env

    if args.command == "env":
        print(_env.markdown_table() if args.markdown else _env.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
