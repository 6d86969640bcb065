"""The gdecode command line. Each command lives in its own module and registers itself here."""

from __future__ import annotations

import sys

import typer

try:  # typer >= 0.22 carries its own copy of click
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc

from engine.errors import GDecodeError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Batch-1 LLM decode, one CUDA graph replay per token.")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors become one `error:` line on stderr and a non-zero exit."""
    from cli import commands  # noqa: F401  (registers every command)

    try:
        code = app(args=argv, standalone_mode=False)
    except GDecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except click_exc.UsageError as e:
        print(f"error: {e.format_message()} (see --help)", file=sys.stderr)
        sys.exit(2)
    except click_exc.ClickException as e:
        print(f"error: {e.format_message()}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    # `python -m cli.main` runs this file as __main__: use the imported module, where commands register
    from cli.main import main as _main

    _main()
