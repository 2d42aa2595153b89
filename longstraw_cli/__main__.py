"""`longstraw <command>`; `python -m longstraw_cli <command>` is the same program (so torchrun -m works)."""

from __future__ import annotations

import sys

COMMANDS = ("train", "plan")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from longstraw_cli.safety.output import guard_console

    # before anything is printed: a closed pipe or terminal never stops a run (the run dir's log has it all)
    guard_console()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: longstraw <command> [overrides]\ncommands: {', '.join(COMMANDS)}\n"
              "  longstraw train --help    the config groups and their options\n"
              "  longstraw plan --help     memory per rank by phase, and the longest prompt that fits")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from longstraw_cli.cli import train

        return train(rest)
    if command == "plan":
        from longstraw_cli.cli import plan

        return plan(rest)
    print(f"longstraw: error: unknown command {command!r}; valid: {list(COMMANDS)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
