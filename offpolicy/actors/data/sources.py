"""Dataset sources: the raw rows of a jsonl or parquet file, a `datasets` folder, or a Hugging Face hub id.

`read_rows(path, split)` returns `(where, row)` pairs in file order, `where` naming the row in errors
(`file:line`, `file row i`). A folder written by `datasets`' `save_to_disk` is read with pyarrow alone
(its `state.json` lists the Arrow stream files; a `DatasetDict` folder has `dataset_dict.json` and one
subfolder per split), so `datasets` is needed only for hub ids: `datasets.load_dataset(path, split=...)`,
tried only when `path` is neither a file nor a folder (the `hf` extra installs it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from offpolicy.actors.errors import DatasetError

Rows = list[tuple[str, Any]]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # `gsm8k`, `openai/gsm8k`
_FILE_SUFFIXES = (".jsonl", ".parquet")


def read_rows(path: str | Path, split: str | None = None) -> Rows:
    """Every row of the dataset at `path`; `split` picks one of a `DatasetDict`'s (folder or hub)."""
    p = Path(path)
    if p.is_file():
        rows = _read_file(p)
    elif p.is_dir():
        rows = _read_folder(p, split)
    elif p.suffix in _FILE_SUFFIXES or not _HUB_ID.match(str(path)):
        raise DatasetError(f"dataset {p} does not exist")
    else:
        rows = _read_hub(str(path), split)
    if not rows:
        raise DatasetError(f"dataset {p} has no records")
    return rows


def _read_file(p: Path) -> Rows:
    if p.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(p.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    rows.append((f"{p}:{n}", json.loads(line)))
                except ValueError as e:
                    raise DatasetError(f"{p}:{n}: not JSON: {e}") from e
        return rows
    if p.suffix == ".parquet":
        return _table_rows(pq.read_table(p), str(p))
    raise DatasetError(f"dataset {p}: expected a .jsonl or .parquet file, a `datasets` folder or a hub id")


def _read_folder(p: Path, split: str | None) -> Rows:
    """A `save_to_disk` folder: a `Dataset` (state.json) or a `DatasetDict` (dataset_dict.json)."""
    if (p / "dataset_dict.json").is_file():
        splits = json.loads((p / "dataset_dict.json").read_text())["splits"]
        return _read_folder(p / _pick_split(p, splits, split), None)
    if not (p / "state.json").is_file():
        raise DatasetError(
            f"dataset {p} is a folder without state.json or dataset_dict.json: not one written by "
            "`datasets`' save_to_disk"
        )
    if split is not None and not (p.parent / "dataset_dict.json").is_file():
        raise DatasetError(f"dataset {p} is one split already; dataset.split={split!r} does not apply")
    state = json.loads((p / "state.json").read_text())
    tables = []
    for entry in state["_data_files"]:
        with pa.memory_map(str(p / entry["filename"])) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    return _table_rows(pa.concat_tables(tables), str(p))


def _pick_split(where: Any, splits: list[str], split: str | None) -> str:
    if split is None and len(splits) == 1:
        return splits[0]
    if split is None or split not in splits:
        wanted = "set dataset.split" if split is None else f"dataset.split={split!r} is not one of them"
        raise DatasetError(f"dataset {where} has the splits {splits}: {wanted}")
    return split


def _read_hub(name: str, split: str | None) -> Rows:
    try:
        import datasets
    except ImportError as e:
        raise DatasetError(
            f"dataset {name!r} is neither a file nor a folder; reading it from the Hugging Face hub needs "
            "the `datasets` package: pip install 'offpolicy[hf]' (or save it with save_to_disk elsewhere "
            "and point dataset.path at the folder)"
        ) from e
    try:
        loaded = datasets.load_dataset(name, split=split)
    except (FileNotFoundError, ConnectionError, ValueError) as e:  # translated: the hub's refusals
        raise DatasetError(f"dataset {name!r}: datasets.load_dataset failed: {type(e).__name__}: {e}") from e
    if isinstance(loaded, datasets.DatasetDict):
        loaded = loaded[_pick_split(name, list(loaded), split)]
    return _table_rows(loaded.data.table, name)


def _table_rows(table: pa.Table, where: str) -> Rows:
    return [(f"{where} row {i}", row) for i, row in enumerate(table.to_pylist())]
