"""``openlora-otel ARGV`` in process, with what it printed."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout

from openlora_otel.cli import main


def run_cli(argv: list[str]) -> tuple[int, str]:
    """Exit status and everything printed (stdout and stderr) of ``openlora-otel ARGV``, in process."""
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        try:
            code = main(argv)
        except SystemExit as exited:  # argparse's usage errors
            code = exited.code
    return int(code or 0), out.getvalue()
