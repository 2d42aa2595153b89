"""`longstraw <command>`; `python -m longstraw_cli <command>` is the same program."""

from __future__ import annotations

import sys

COMMANDS = ("train", "demo")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: longstraw <command> [args]\ncommands: {', '.join(COMMANDS)}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from longstraw_cli.cli import train

        return train(rest)
    if command == "demo":
        from longstraw_cli.demo import main as demo

        return demo(rest)
    print(f"longstraw: unknown command {command!r}; valid: {list(COMMANDS)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
