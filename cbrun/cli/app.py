"""The `cbrun` command: a Typer app, run through `main()` so every usage error is one line.

`bench` is registered when `cbrun.cli.bench` is importable; a broken or missing
bench module never breaks `generate` or `--help`.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from cbrun.cli.common import EXIT_INTERRUPTED, EXIT_USAGE, CliError
from cbrun.cli.generate import generate
from cbrun.cli.generate_options import GenerateOptions
from cbrun.cli.info import info, version_text
from cbrun.cli.options import command
from cbrun.cli.score import ScoreOptions, score

app = typer.Typer(
    name="cbrun",
    help="Batch inference for LLMs with an in-process continuous-batching engine.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("generate")(command(GenerateOptions, generate))
app.command("score")(command(ScoreOptions, score))
app.command("info")(info)


@app.callback(invoke_without_command=True)
def _options(
    ctx: typer.Context, version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False
) -> None:
    if version:
        print(version_text())
        raise typer.Exit(0)
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())
        raise typer.Exit(0)


def _register_bench() -> None:
    error: Exception
    try:
        from cbrun.cli.bench import bench
        from cbrun.cli.bench_options import BenchOptions

        bench_command = command(BenchOptions, bench)
    except Exception as exc:  # a bug in bench must not take generate down
        error = exc
    else:
        app.command("bench")(bench_command)
        return
    message = f"cbrun bench is unavailable: {type(error).__name__}: {error}"

    @app.command("bench", help="(unavailable: see the message)")
    def bench_unavailable() -> None:
        raise CliError(message)


_register_bench()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 rows failed, 2 usage error, 130 interrupted)."""
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="cbrun", standalone_mode=False)
    except CliError as exc:
        _error(str(exc))
        return exc.exit_code
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        _error("aborted")
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_INTERRUPTED
    except typer.TyperException as exc:  # click usage errors (bad option, missing value, bad choice)
        message = exc.format_message()
        if message:  # empty when the help was already printed (no arguments at all)
            _error(message)
        return getattr(exc, "exit_code", EXIT_USAGE) or EXIT_USAGE
    return result if isinstance(result, int) else 0


def _error(message: str) -> None:
    print(f"cbrun: error: {' '.join(message.split())}", file=sys.stderr)
