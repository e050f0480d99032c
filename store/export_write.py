"""Writing an export's rows (store/export.py selects them into temporary tables first): the SQL
that joins the texts in, in TRL's conversational or text format, and the writers for JSONL,
Parquet (DuckDB's COPY) and `datasets` folders (through Arrow files).

    _export           the selected pairs, with their split (and `weight`, with quality_weights)
    _export_rankings  the selected rankings, with their split (their annotators' own answers are
                      the demonstrations)
    _export_prompts   (prompt_id, prompt) every exported prompt as chat messages (conversational)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa

from formats.chat import TURN_START, prompt_messages
from store.db import registered
from store.export_options import ExportOptions
from store.records import HUMAN_EDIT, STRENGTHS

_TIME = "strftime({}.created_at, '%Y-%m-%dT%H:%M:%S.%fZ') AS created_at"
_WRITE = """
    SELECT {prompt} AS prompt, {chosen} AS chosen, {rejected} AS rejected, s.margin AS rank_gap, {margin} {weight}
           s.strength, s.rationale, a.name AS annotator, s.prompt_id, s.chosen_id, s.rejected_id,
           c.model_version_id AS chosen_model_version, r.model_version_id AS rejected_model_version,
           cm.name AS chosen_model, rm.name AS rejected_model, s.pair_id, s.ranking_id, s.all_bad, s.agreement,
           s.source, s.round_id AS round, s.conversation_id, s.turn, {time}, s.split
    FROM _export s
    JOIN prompts p ON p.id = s.prompt_id
    JOIN responses c ON c.id = s.chosen_id
    JOIN responses r ON r.id = s.rejected_id
    JOIN model_versions cm ON cm.id = c.model_version_id
    JOIN model_versions rm ON rm.id = r.model_version_id
    LEFT JOIN annotators a ON a.id = s.annotator_id
    LEFT JOIN _export_prompts m ON m.prompt_id = s.prompt_id
    {where}
    ORDER BY s.pair_id
"""
_WRITE_RANKINGS = """
    WITH resp AS (
        SELECT x.item_id, list({{'response_id': x.id, 'text': x.text, 'model_version': x.model_version_id,
                                 'model': mv.name}} ORDER BY x.id) AS responses
        FROM responses x JOIN model_versions mv ON mv.id = x.model_version_id
        WHERE x.item_id IN (SELECT item_id FROM _export_rankings) GROUP BY x.item_id)
    SELECT k.ranking_id, k.item_id, k.prompt_id, {prompt} AS prompt, resp.responses,
           k.order_groups AS "order", k.display_order, k.all_bad, k.strength, a.name AS annotator, k.duration_s,
           k.comment, k.round_id AS round, k.conversation_id, k.turn, {time}, k.split
    FROM _export_rankings k
    JOIN prompts p ON p.id = k.prompt_id
    JOIN resp ON resp.item_id = k.item_id
    LEFT JOIN annotators a ON a.id = k.annotator_id
    LEFT JOIN _export_prompts m ON m.prompt_id = k.prompt_id
    ORDER BY k.ranking_id
"""


# TRL's margin: the annotator's strength where the pair has one (records.STRENGTHS), else the rank gap.
_STRENGTH_MARGIN = ("CASE s.strength " + " ".join(f"WHEN '{name}' THEN {value!r}" for name, value in STRENGTHS.items())
                    + " ELSE s.margin END")


def _reply(column: str, trl_format: str) -> str:
    return f"[{{'role': 'assistant', 'content': {column}}}]" if trl_format == "conversational" else column


def pairs_sql(trl_format: str, margin_column: bool, where: str = "", weight_column: bool = False) -> str:
    """The query that writes the pairs (over the temporary tables export_dataset builds)."""
    prompt = "m.prompt" if trl_format == "conversational" else "p.text"
    return _WRITE.format(prompt=prompt, chosen=_reply("c.text", trl_format),
                         rejected=_reply("r.text", trl_format), time=_TIME.format("s"),
                         margin=f"{_STRENGTH_MARGIN} AS margin," if margin_column else "",
                         weight="s.weight AS weight," if weight_column else "", where=where)


def rankings_sql(trl_format: str) -> str:
    """The query that writes the rankings (over the temporary tables export_dataset builds)."""
    prompt = "m.prompt" if trl_format == "conversational" else "p.text"
    return _WRITE_RANKINGS.format(prompt=prompt, time=_TIME.format("k"))


_WRITE_DEMONSTRATIONS = """
    SELECT {row}, a.name AS annotator, k.prompt_id, e.id AS response_id, s.id AS edit_of,
           sm.name AS edit_of_model, k.ranking_id, k.round_id AS round, k.conversation_id, k.turn, {time},
           k.split
    FROM _export_rankings k
    JOIN responses e ON json_extract(e.sampling, '$.ranking_id')::BIGINT = k.ranking_id
    JOIN responses s ON s.id = json_extract(e.sampling, '$.edit_of')::BIGINT
    JOIN model_versions sm ON sm.id = s.model_version_id
    JOIN prompts p ON p.id = k.prompt_id
    LEFT JOIN annotators a ON a.id = k.annotator_id
    LEFT JOIN _export_prompts m ON m.prompt_id = k.prompt_id
    WHERE e.model_version_id = (SELECT id FROM model_versions WHERE name = '{human}')
    ORDER BY k.ranking_id
"""


def demonstrations_sql(trl_format: str) -> str:
    """The query that writes the demonstrations, the selected rankings' own answers (records.EditIn),
    in TRL's SFT formats: conversational `messages` (the prompt's, then the answer), or text
    `prompt` and `completion`."""
    row = ("list_concat(m.prompt, [{'role': 'assistant', 'content': e.text}]) AS messages"
           if trl_format == "conversational" else "p.text AS prompt, e.text AS completion")
    return _WRITE_DEMONSTRATIONS.format(row=row, time=_TIME.format("e"), human=HUMAN_EDIT)


def write_demonstrations(cur, path: Path, trl_format: str) -> int:
    """The demonstrations as JSON Lines at `path` (any export format: TRL's SFT reads JSON Lines);
    nothing is written when there are none. Returns how many."""
    n = cur.execute(f"COPY ({demonstrations_sql(trl_format)}) TO '{_sql_path(path)}' (FORMAT json)").fetchall()[0][0]
    if not n:
        remove(path)
    return n


def prompts_table(cur, trl_format: str) -> None:
    """_export_prompts(prompt_id, prompt): every exported prompt as chat messages (conversational;
    formats/chat.py prompt_messages). A prompt of one plain text (no stored messages, not an HH
    transcript) is one user message, written by DuckDB; the others go through prompt_messages."""
    ids = "SELECT prompt_id FROM _export UNION SELECT prompt_id FROM _export_rankings"
    plain = f"messages IS NULL AND NOT regexp_matches(ltrim(text, ' '), '{TURN_START}')"
    rows = [] if trl_format != "conversational" else cur.execute(
        f"SELECT id, text, messages FROM prompts WHERE id IN ({ids}) AND NOT ({plain})").fetchall()
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    table = pa.table({
        "prompt_id": pa.array([r[0] for r in rows], pa.int64()),
        "prompt": pa.array([prompt_messages(r[1], None if r[2] is None else json.loads(r[2])) for r in rows],
                           pa.list_(message)),
    })
    with registered(cur, "_prompts_in", table):
        cur.execute("CREATE OR REPLACE TEMP TABLE _export_prompts AS SELECT * FROM _prompts_in")
    if trl_format == "conversational":
        cur.execute("INSERT INTO _export_prompts SELECT id, [{'role': 'user', 'content': text}] FROM prompts "
                    f"WHERE id IN ({ids}) AND {plain}")


def write_data(cur, pairs: Path, rankings: Path, options: ExportOptions, has_test: bool) -> None:
    """The pairs and the rankings (tables _export, _export_rankings, _export_prompts) to these
    paths in the options' format, TRL format and columns: DuckDB streams COPY for jsonl and
    parquet; `datasets` folders go through Arrow files."""
    trl_format, margin, weight = options.trl_format, options.margin_column, options.quality_weights
    if options.format == "datasets":
        import datasets  # imported here: it is slow to import and only this format needs it

        splits = ("train", "test") if has_test else ("train",)
        with _ArrowStaging(pairs.with_name(pairs.name + ".arrow")) as arrow:
            parts = {split: arrow(cur, pairs_sql(trl_format, margin, f"WHERE s.split = '{split}'", weight))
                     for split in splits}
            datasets.DatasetDict(parts).save_to_disk(str(pairs))
            arrow(cur, rankings_sql(trl_format)).save_to_disk(str(rankings))
            del parts
        return
    copy = "FORMAT json" if options.format == "jsonl" else "FORMAT parquet, COMPRESSION zstd"
    cur.execute(f"COPY ({pairs_sql(trl_format, margin, '', weight)}) TO '{_sql_path(pairs)}' ({copy})")
    cur.execute(f"COPY ({rankings_sql(trl_format)}) TO '{_sql_path(rankings)}' ({copy})")


class _ArrowStaging:
    """A staging folder of Arrow files: `arrow(cur, sql)` streams a query from DuckDB into one and
    memory-maps it as a `datasets.Dataset` (the rows never sit in RAM all at once). The folder is
    removed on leaving."""

    def __init__(self, folder: Path):
        self.folder, self.n = folder, 0

    def __enter__(self):
        remove(self.folder)
        self.folder.mkdir()
        return self

    def __exit__(self, *exc):
        shutil.rmtree(self.folder, ignore_errors=True)

    def __call__(self, cur, sql: str):
        import datasets

        reader = cur.sql(sql).to_arrow_reader(50_000)
        schema = pa.schema([pa.field(f.name, _plain(f.type)) for f in reader.schema])
        self.n += 1
        path = self.folder / f"{self.n}.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for batch in reader:
                writer.write_batch(_defined(batch if batch.schema == schema else batch.cast(schema)))
        return datasets.Dataset.from_file(str(path))


def _defined(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The batch with every byte defined. Arrow leaves the bytes under a null slot undefined, and
    DuckDB hands out whatever its memory held there, so two exports of the same rows differed byte
    for byte and hashed differently (formats/hashing.py hashes the files). A column with nulls, or
    with nulls at any depth is rebuilt, which writes zeros under them."""
    columns = [pa.array(c.to_pylist(), type=c.type) if _has_nulls(c) else c for c in batch.columns]
    return pa.RecordBatch.from_arrays(columns, schema=batch.schema)


def _has_nulls(a: pa.Array) -> bool:
    if a.null_count:
        return True
    if pa.types.is_list(a.type):
        return _has_nulls(a.values)
    if pa.types.is_struct(a.type):
        return any(_has_nulls(a.field(i)) for i in range(a.type.num_fields))
    return False


def _plain(t: pa.DataType) -> pa.DataType:
    """The type with plain strings at every depth: DuckDB may hand out string views (and large
    strings), which `datasets` does not take."""
    if pa.types.is_string_view(t) or pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t):
        return pa.list_(_plain(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _plain(f.type)) for f in t])
    return t


def write_text(path: Path, text: str) -> None:
    """Under a temporary name first: a crash never leaves half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _sql_path(path: Path) -> str:
    return str(path).replace("'", "''")


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
