"""The gdecode command line. Each command lives in its own module and registers itself here."""

from __future__ import annotations

import sys

import typer

from engine.errors import GDecodeError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Batch-1 LLM decode, one CUDA graph replay per token.")


def _register():
    from cli import commands  # noqa: F401  (imports every command module)


def main():
    _register()
    try:
        app(standalone_mode=False)
    except GDecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
