"""The ``kt-ops`` command line (also ``python -m kt_ops``): ``kt-ops info``, ``kt-ops demo [...]``,
``kt-ops convert [...]``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kt-ops`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kt-ops", description=__doc__)
    parser.add_argument("command", choices=["info", "demo", "convert"], help="what to run")
    # Only the first word is ours: everything after it (--help included) goes to the subcommand.
    args = parser.parse_args(argv[:1])
    rest = argv[1:]
    # Each subcommand is imported when it runs: demo needs transformers, convert safetensors
    # and gguf (optional dependencies), info neither.
    if args.command == "info":
        from kt_ops.info import main as info_main

        info_main()
        return 0
    if args.command == "convert":
        from kt_ops.convert import main as convert_main

        return int(convert_main(rest) or 0)
    from kt_ops.demo import main as demo_main

    return int(demo_main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
