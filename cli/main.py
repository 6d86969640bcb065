"""The gdecode command line. Each command lives in its own module and registers itself here."""

from __future__ import annotations

import os
import sys
from importlib import metadata
from typing import get_args

import typer
import typer.main

try:  # typer >= 0.22 carries its own copy of click
    from typer import _click as click
except ImportError:  # pragma: no cover
    import click

from engine.errors import GDecodeError

HELP_NAMES = ["-h", "--help"]
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": HELP_NAMES},
                  help="Batch-1 LLM decode, one CUDA graph replay per token.")


def version() -> str:
    try:
        return metadata.version("gdecode")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"gdecode {version()}")
        raise typer.Exit()


@app.callback()
def _root(_version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                        help="Print the version and exit.")):
    """Batch-1 LLM decode, one CUDA graph replay per token."""


def silence(stream) -> None:
    """Point a stream whose reader went away at /dev/null, so that no later flush (at exit too) raises."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


def _is_devnull(stream) -> bool:
    try:
        return os.path.samestat(os.fstat(stream.fileno()), os.stat(os.devnull))
    except (OSError, ValueError):
        return False


def _tidy_help(cmd, default_model, default_name: str) -> None:
    """What the help shows: no type after a flag, a list as its element type, a range as its number
    type (the range follows), and the default model as its short name rather than a long absolute path."""
    subs = getattr(cmd, "commands", {})
    ctx = click.Context(cmd, info_name=cmd.name, help_option_names=HELP_NAMES)
    params = [*cmd.params, cmd.get_help_option(ctx)]
    for p in params:
        if p is None:
            continue
        elem = get_args(getattr(getattr(p, "type_descriptor", None), "annotation", None))
        label = f"<{getattr(elem[0], '__name__', 'text').lower()}>" if elem else None
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
        elif label and p.param_type_name == "option" and p.metavar is None:
            p.metavar = label
        elif label:  # an argument shows its type whatever its metavar
            p.display_type_rich = lambda ctx, label=label: label
        elif p.metavar is None and (getattr(p, "min", None) is not None or getattr(p, "max", None) is not None):
            kind = getattr(getattr(p, "type_descriptor", None), "annotation", None)
            p.metavar = f"<{getattr(kind, '__name__', 'number')}>"  # not "<int range>": the range follows it
        if getattr(p, "default", None) == default_model and p.show_default is True:
            p.show_default = default_name
    for sub in subs.values():
        _tidy_help(sub, default_model, default_name)


def build():
    """The click command of the whole app, with every command registered and the help tidied."""
    from cli import commands  # noqa: F401  (registers every command)
    from engine.llm import DEFAULT_MODEL, DEFAULT_MODEL_NAME

    cmd = typer.main.get_command(app)
    _tidy_help(cmd, DEFAULT_MODEL, DEFAULT_MODEL_NAME)
    return cmd


def _show_help_on_stderr(ctx) -> None:
    from contextlib import redirect_stdout

    with redirect_stdout(sys.stderr):
        text = ctx.get_help()  # typer's rich help prints itself and returns ""
    if text:
        print(text, file=sys.stderr)


def run(argv: list[str] | None = None) -> int:
    """Parse and run one command line; returns the exit status. Every failure becomes one line on stderr."""
    cmd = build()
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        with cmd.make_context("gdecode", args) as ctx:
            cmd.invoke(ctx)
        return 0
    except click.exceptions.NoArgsIsHelpError as e:
        # as click does: asking for nothing is a usage error (exit 2), answered with the help alone
        _show_help_on_stderr(e.ctx)
        return 2
    except GDecodeError as e:
        _error(str(e))
        return 1
    except click.exceptions.UsageError as e:
        _error(f"{e.format_message()} (see --help)")
        return 2
    except click.exceptions.ClickException as e:
        _error(e.format_message())
        return e.exit_code
    except typer.Exit as e:
        return e.exit_code
    except (KeyboardInterrupt, typer.Abort):
        _error_quiet("interrupted")
        return 130
    except BrokenPipeError:
        silence(sys.stdout)
        return 0
    except SystemExit as e:
        # rich (help, tables) meets a closed pipe by pointing stdout at /dev/null and exiting 1
        if e.code == 1 and _is_devnull(sys.stdout):
            return 0
        raise
    except MemoryError:
        _error("out of host memory")
        return 1


def _error(msg: str) -> None:
    _error_quiet(f"error: {' '.join(msg.split())}")


def _error_quiet(msg: str) -> None:
    try:
        print(msg, file=sys.stderr, flush=True)
    except BrokenPipeError:
        silence(sys.stderr)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors become one `error:` line on stderr and a non-zero exit."""
    sys.exit(run(argv))


if __name__ == "__main__":
    # `python -m cli.main` runs this file as __main__: use the imported module, where commands register
    from cli.main import main as _main

    _main()
