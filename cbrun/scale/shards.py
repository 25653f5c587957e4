"""Deterministic shards: N processes split one dataset with no communication.

A row belongs to shard `blake2b(id) mod N`, where the id is what the output's
`id` column will hold (`id`, else `custom_id`, else the 0-based row number).
blake2b, not Python's `hash()`: the latter is salted per process, so two
machines would disagree on where a row goes. Every process reads the whole
input and keeps its own rows; rows of other shards are dropped before parsing
the prompt, so they are neither counted nor written. A bad row still has an id
(its row number when the id itself is missing or bad), so it lands in exactly
one shard and is reported there once.

Where the numbers come from, first match wins (flags override either number):

    --shard-index / --num-shards           given on the command line
    SLURM_ARRAY_TASK_ID / _COUNT           a Slurm job array; the index is
                                           (ID - SLURM_ARRAY_TASK_MIN) / SLURM_ARRAY_TASK_STEP
    JOB_COMPLETION_INDEX / CBRUN_NUM_SHARDS  a Kubernetes Indexed Job (it sets the index only;
                                           set CBRUN_NUM_SHARDS to the Job's `completions`)
    RANK / WORLD_SIZE                      torchrun, MPI-style launchers

One shard (N = 1) is no sharding: the output is written as given.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from cbrun.data.reader import RawRow
from cbrun.data.rows import record_id

SHARD_PLACEHOLDER = "{shard"  # `{shard}` or a format spec such as `{shard:05d}` in OUTPUT


class ShardError(ValueError):
    """The shard numbers are missing, contradictory or out of range; one line."""


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count`; `source` says where the numbers came from (for the summary)."""

    index: int
    count: int
    source: str

    def owns(self, row_id: str) -> bool:
        return shard_of(row_id, self.count) == self.index

    def describe(self) -> str:
        return f"{self.index} of {self.count} (from {self.source})"

    def part_name(self, suffix: str) -> str:
        """The file name of this shard's part in an output directory."""
        return f"part-{self.index:05d}-of-{self.count:05d}{suffix}"


def shard_of(row_id: str, count: int) -> int:
    """The shard of a row id: stable across processes, machines and Python versions."""
    digest = hashlib.blake2b(row_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count


# (index variable, count variable) of the schedulers that give shard numbers, in the order they are tried:
# a Slurm job array, a Kubernetes Indexed Job (which sets no count: CBRUN_NUM_SHARDS), torchrun / MPI launchers
_SCHEDULERS = (
    ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"),
    ("JOB_COMPLETION_INDEX", "CBRUN_NUM_SHARDS"),
    ("RANK", "WORLD_SIZE"),
)


def resolve_shard(
    num_shards: int | None, shard_index: int | None, env: Mapping[str, str] | None = None
) -> Shard | None:
    """This process's shard, or None when the job is not sharded (N = 1 or nothing set).

    Raises ShardError with a one-line message for missing, non-numeric or out-of-range numbers.
    """
    index, count = shard_index, num_shards
    index_from, count_from = "--shard-index", "--num-shards"
    found = None
    if index is None or count is None:
        found = _from_environment(os.environ if env is None else env)
    if found is not None:
        if index is None:
            index, index_from = found.index, found.index_source
        if count is None and found.count is not None:
            count, count_from = found.count, found.count_source
    if index is None and count is None:
        return None
    if count is None:
        if found is not None:
            raise ShardError(
                f"{found.index_source} is set but the number of shards is not: "
                f"set {found.count_source} or pass --num-shards"
            )
        raise ShardError("--shard-index needs --num-shards (or a scheduler's shard count in the environment)")
    if count < 1:
        raise ShardError(f"the number of shards must be at least 1, got {count} ({count_from})")
    if index is None:
        if count == 1:
            return None
        raise ShardError("--num-shards needs --shard-index (or a scheduler's task index in the environment)")
    if not 0 <= index < count:
        raise ShardError(
            f"shard index {index} ({index_from}) is outside 0..{count - 1} for {count} shards ({count_from})"
        )
    if count == 1:
        return None
    flags = index_from == "--shard-index" and count_from == "--num-shards"
    return Shard(index, count, "--shard-index/--num-shards" if flags else f"{index_from}; {count_from}")


@dataclass(frozen=True)
class _Found:
    """Shard numbers read from a scheduler's environment, with the variables they came from."""

    index: int
    index_source: str
    count: int | None
    count_source: str


def _from_environment(env: Mapping[str, str]) -> _Found | None:
    """The shard numbers of the first scheduler (in `_SCHEDULERS` order) that set a task index."""
    for index_var, count_var in _SCHEDULERS:
        raw_index = env.get(index_var, "")
        if not raw_index.strip():
            continue
        index = _env_int(env, index_var)
        index_source = f"{index_var}={raw_index.strip()}"
        if index_var == "SLURM_ARRAY_TASK_ID":
            index, index_source = _slurm_index(env, index, index_source)
        raw_count = env.get(count_var, "")
        if not raw_count.strip():
            return _Found(index, index_source, None, count_var)
        return _Found(index, index_source, _env_int(env, count_var), f"{count_var}={raw_count.strip()}")
    return None


def _slurm_index(env: Mapping[str, str], task_id: int, source: str) -> tuple[int, str]:
    """A Slurm array's task id as a 0-based index: `--array=1-8` and `--array=0-14:2` both give 0..7."""
    first = _env_int(env, "SLURM_ARRAY_TASK_MIN", default=0)
    step = _env_int(env, "SLURM_ARRAY_TASK_STEP", default=1) or 1
    if (task_id - first) % step:
        raise ShardError(
            f"SLURM_ARRAY_TASK_ID={task_id} is not on the array's step (min {first}, step {step}); "
            "use one --array=A-B[:S] range, or pass --shard-index"
        )
    if first:
        source += f" - SLURM_ARRAY_TASK_MIN={first}"
    if step != 1:
        source += f", / SLURM_ARRAY_TASK_STEP={step}"
    return (task_id - first) // step, source


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or not raw.strip():
        if default is None:
            raise ShardError(f"{name} is not set")
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise ShardError(f"{name} must be an integer, got {raw!r}") from None


def select_rows(rows: Iterable[RawRow], shard: Shard) -> Iterator[RawRow]:
    """The rows of `shard`, in input order, with their global row numbers kept (error messages name them)."""
    for raw in rows:
        if shard.owns(row_id_of(raw)):
            yield raw


def row_id_of(raw: RawRow) -> str:
    """The id the output row will carry: id, else custom_id, else the row number (also for unparseable rows)."""
    return str(raw.index) if raw.record is None else record_id(raw.record, raw.index)[0]


def shard_output(spec: str, shard: Shard) -> tuple[str, bool]:
    """This shard's OUTPUT and whether it lives in a directory of part files.

    `out-{shard}.jsonl` (any str.format spec, plus `{num_shards}`) names one file per shard;
    plain `out.parquet` becomes the directory `out.parquet/` holding `part-00003-of-00008.parquet`,
    which readers (cbrun, pyarrow, Hugging Face datasets) take as one dataset. `-` stays stdout.
    """
    if spec == "-":
        return spec, False
    if "{" in spec and "}" in spec:
        try:
            named = spec.format(shard=shard.index, num_shards=shard.count)
        except (KeyError, IndexError, ValueError) as exc:
            raise ShardError(
                f"cannot fill in OUTPUT {spec!r}: only {{shard}} and {{num_shards}} may appear in braces ({exc})"
            ) from None
        if SHARD_PLACEHOLDER not in spec:
            raise ShardError(f"OUTPUT {spec!r} has no {{shard}}: every shard would write the same file")
        return named, False
    path = Path(spec)
    if path.exists() and not path.is_dir():
        raise ShardError(
            f"{spec} is a file; a sharded run writes a directory of part files there "
            f"(remove it, or name one file per shard with {{shard}}, e.g. out-{{shard}}.parquet)"
        )
    return str(path / shard.part_name(path.suffix.lower())), True
