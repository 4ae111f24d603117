"""``torch-tpu`` (or ``python -m torch_tpu``), the command line:

- ``env [--markdown]``: the environment variables torch_tpu reads, with the values in force
  (``--markdown``: docs/environment.md, generated from the registry);
- ``doctor PATH...``: what keeps a codebase on CUDA (``torch-tpu doctor --help``);
- ``bench``: a workload on each target side by side (``torch-tpu bench --help``)."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["doctor"]:  # its own parser, so that --help shows its options
        from . import doctor

        return doctor.main(argv[1:])
    if argv[:1] == ["bench"]:
        from . import bench

        return bench.main(argv[1:])
    parser = argparse.ArgumentParser(prog="torch-tpu")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="list the environment variables with the values in force")
    env.add_argument("--markdown", action="store_true",
                     help="print docs/environment.md instead (regenerate it: "
                          "python -m torch_tpu env --markdown > docs/environment.md)")
    sub.add_parser("doctor", help="find what keeps a codebase on CUDA (torch-tpu doctor --help)")
    sub.add_parser("bench", help="your workload on each target, in cost per 1M tokens (torch-tpu bench --help)")
    args = parser.parse_args(argv)
    from . import _env

    if args.command == "env":
        if args.markdown:
            sys.stdout.write(_env.markdown_page())
        else:
            print(_env.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
