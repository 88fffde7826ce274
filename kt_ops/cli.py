"""The ``kt-ops`` command line: ``kt-ops info`` and ``kt-ops demo [...]``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kt-ops`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kt-ops", description=__doc__)
    parser.add_argument("command", choices=["info", "demo"], help="what to run")
    args, rest = parser.parse_known_args(argv)
    if args.command == "info":
        from kt_ops.info import main as info_main

        info_main()
        return 0
    from kt_ops.demo import main as demo_main

    return int(demo_main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
