"""OUTPUT as generate and score write it: stdout, a JSON Lines file or a Parquet file (through its journal).

Everything about OUTPUT that can be refused (its format, a missing directory,
an existing file without --resume or --overwrite, resume state that cannot be
read) is refused here, before any model loads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from cbrun.cli.common import CliError

if TYPE_CHECKING:
    from cbrun.data.job import OutputFormat, RowWriter
    from cbrun.data.resume import ResumeState


@dataclass
class OutputTarget:
    """Where results go: kind is "stdout", "jsonl" or "parquet"."""

    kind: str
    path: Path | None

    @classmethod
    def parse(cls, output: str, input_path: str | None) -> OutputTarget:
        """OUTPUT as given (a path, or - for stdout), checked against INPUT's path."""
        if output == "-":
            return cls("stdout", None)
        path = Path(output)
        suffix = path.suffix.lower()
        kind = "parquet" if suffix == ".parquet" else "jsonl" if suffix in (".jsonl", ".json", ".ndjson") else None
        if kind is None:
            raise CliError(f"unknown output format: {output} (use .jsonl, .parquet or - for stdout)")
        if not path.parent.is_dir():
            raise CliError(f"output directory does not exist: {path.parent}")
        if input_path not in (None, "-") and Path(input_path).resolve() == path.resolve():
            raise CliError("OUTPUT must not be the INPUT file")
        return cls(kind, path)

    @property
    def where(self) -> str:
        """OUTPUT as the summary names it."""
        return "stdout" if self.path is None else str(self.path)

    def existing(self) -> list[Path]:
        from cbrun.data.writers import journal_path

        if self.path is None:
            return []
        candidates = [self.path] + ([journal_path(self.path)] if self.kind == "parquet" else [])
        return [p for p in candidates if p.exists()]

    def check_existing(self, resume: bool, overwrite: bool) -> None:
        if resume and overwrite:
            raise CliError("--resume and --overwrite contradict each other")
        if resume and self.kind == "stdout":
            raise CliError("--resume needs an OUTPUT file (not -)")
        found = self.existing()
        if found and not resume and not overwrite:
            raise CliError(f"{found[0]} exists (use --resume to finish that job, or --overwrite to replace it)")

    def resume_state(self, classify: Callable[[dict], Any]) -> ResumeState:
        """What OUTPUT already holds (read, and repaired after a kill, before the model loads).

        classify: the output format's resume key of one row (CbrunFormat.classify, ...).
        """
        from cbrun.data.resume import ResumeError, load_resume_state

        assert self.path is not None  # check_existing refused --resume to stdout
        try:
            return load_resume_state(self.path, self.kind, classify)
        except ResumeError as exc:
            raise CliError(str(exc)) from None

    def open_writer(self, fmt: OutputFormat, data_stream: IO[bytes] | None, append: bool) -> RowWriter:
        """A writer of `fmt`'s rows: to `data_stream` (the real stdout) for `-`, else to the file (appending to
        what is there when resuming)."""
        from cbrun.data.writers import JsonlWriter, ParquetOutput, TableFormat

        if self.path is None:
            assert data_stream is not None  # claimed by claim_stdout for `-`
            return JsonlWriter(data_stream, fsync=False)
        if not append:
            for path in self.existing():
                path.unlink()
        if self.kind == "parquet":
            assert isinstance(fmt, TableFormat)  # Parquet OUTPUT is refused for formats without columns (OpenAI)
            return ParquetOutput(self.path, fmt)
        return JsonlWriter.open(self.path, append=append)
