"""``python -m tether`` and the ``tether`` console script."""

from __future__ import annotations

from tether.worker.heap import pause_collection


def main() -> None:
    # The collector is off while the CLI and the command's modules are imported; the group's
    # callback (or `tether worker`, after its own imports) resumes it (tether.worker.heap).
    pause_collection()
    from tether.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
