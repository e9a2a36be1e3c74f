"""QA loaders, the Arrow-backed retrieval corpus, and the bundled samples.

``load_qa`` reads the QA layouts ragfast meets (HotpotQA's Hugging Face jsonl and original
json, FlashRAG jsonl, Search-R1 parquet, MuSiQue, MetaQA txt, TAT-QA raw json) into
:class:`ragfast.types.Question` records. ``load_corpus`` reads a wiki-18-style corpus
(``{"id", "contents"}`` rows) into a :class:`Corpus` whose rows stay in Arrow buffers: the
21M-passage wiki-18 file never becomes 21M Python dicts.
"""
from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ragfast.errors import ConfigError, DataError
from ragfast.data.passage_store import map_arrow_table, write_arrow_corpus
from ragfast.types import Passage, Question

__all__ = [
    "SAMPLES",
    "sample",
    "load_qa",
    "load_corpus",
    "load_triples",
    "corpus_from_contexts",
    "Corpus",
    "detect_layout",
    "inspect",
]

#: Bundled sample name -> path inside ``ragfast/samples`` (see samples/PROVENANCE.md).
SAMPLES: dict[str, str] = {
    "hotpotqa-train": "hotpotqa/train.jsonl",
    "hotpotqa-dev": "hotpotqa/dev.jsonl",
    "hotpotqa-train-extra": "hotpotqa/train_extra.jsonl",
    "wiki-sample": "wiki_sample/passages.jsonl",
    "tatqa-dev": "tatqa/dev.json",
    "metaqa-kb": "metaqa/kb.txt",
    "metaqa-1hop": "metaqa/1hop_test.txt",
    "metaqa-2hop": "metaqa/2hop_test.txt",
    "metaqa-3hop": "metaqa/3hop_test.txt",
}


def sample(name: str) -> Path:
    """Path of a bundled sample file.

    Parameters
    ----------
    name : str
        One of :data:`SAMPLES`: hotpotqa-train, hotpotqa-dev, hotpotqa-train-extra, wiki-sample,
        tatqa-dev, metaqa-kb, metaqa-1hop, metaqa-2hop, metaqa-3hop.

    Raises
    ------
    DataError
        For an unknown name (the message lists the valid ones).
    """
    if name not in SAMPLES:
        raise DataError(f"unknown sample {name!r}; valid names: {', '.join(SAMPLES)}")
    path = Path(str(resources.files("ragfast") / "samples" / SAMPLES[name]))
    if not path.is_file():
        raise DataError(f"bundled sample {name!r} is missing from the installation: {path}")
    return path


def _resolve(path: str | Path) -> Path:
    """A path, or a sample name standing for its bundled file."""
    if isinstance(path, str) and path in SAMPLES:
        return sample(path)
    p = Path(path)
    if not p.exists():
        raise DataError(f"no such file: {p} (not a sample name either; samples: {', '.join(SAMPLES)})")
    if p.is_dir():
        raise DataError(f"{p} is a directory; give a data file")
    return p


# ---------------------------------------------------------------------------------------------
# layout detection
# ---------------------------------------------------------------------------------------------
def _text_lines(p: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line without its newline) for every non-blank line of ``p``."""
    with open(p, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{p}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
            if line.strip():
                yield n, line.rstrip("\n\r")


def _first_json_line(p: Path) -> tuple[dict[str, Any], int]:
    for n, line in _text_lines(p):
        return _parse_line(line, p, n), n
    raise DataError(f"{p}: the file is empty")


def _parse_line(line: str, p: Path, n: int) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{p}:{n}: line does not parse as JSON (column {exc.colno}: {exc.msg})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{p}:{n}: expected a JSON object per line, got {type(obj).__name__}")
    return obj


def _layout_of_record(rec: dict[str, Any]) -> str | None:
    keys = set(rec)
    if {"table", "questions", "paragraphs"} <= keys:
        return "tatqa"
    if "paragraphs" in keys and "question" in keys:
        return "musique"
    if {"supporting_facts", "context", "question"} <= keys:
        return "hotpotqa" if isinstance(rec["context"], dict) else "hotpotqa-orig"
    if "golden_answers" in keys and "question" in keys:
        return "flashrag"
    if {"prompt", "reward_model"} <= keys:
        return "searchr1"
    if {"id", "contents"} <= keys:
        return "corpus"
    return None


def _load_json_file(p: Path) -> Any:
    try:
        with open(p, encoding="utf-8") as f:
            return json.load(f)
    except UnicodeDecodeError as exc:
        raise DataError(f"{p}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{p}:{exc.lineno}: JSON does not parse (column {exc.colno}: {exc.msg})") from None


def detect_layout(path: str | Path) -> str:
    """Name the layout of a data file.

    Returns one of ``hotpotqa`` (HF jsonl), ``hotpotqa-orig`` (original json), ``flashrag``,
    ``searchr1`` (parquet), ``musique``, ``metaqa``, ``tatqa``, ``corpus`` (wiki-18 rows) or
    ``triples`` (MetaQA ``head|relation|tail`` knowledge base).

    Raises
    ------
    DataError
        For a missing file or a layout ragfast does not know.
    """
    p = _resolve(path)
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        try:
            names = set(pq.read_schema(p).names)
        except pa.ArrowException as exc:
            raise DataError(f"{p}: not a readable parquet file ({exc})") from None
        lay = _layout_of_record({k: None for k in names})
        if lay in ("searchr1", "flashrag", "corpus"):
            return lay
        raise DataError(f"{p}: unknown parquet layout with columns {sorted(names)}; expected Search-R1 "
                        "(prompt, reward_model, ...), FlashRAG (id, question, golden_answers) "
                        "or a corpus (id, contents)")
    if suffix == ".txt" or suffix == ".tsv":
        first = next((ln for _, ln in _text_lines(p)), None)
        if first is None:
            raise DataError(f"{p}: the file is empty")
        if "\t" in first:
            return "metaqa"
        if first.count("|") >= 2:
            return "triples"
        raise DataError(f"{p}: unknown text layout; expected MetaQA questions 'question [entity]<TAB>a|b' "
                        "or 'head|relation|tail' triples")
    if suffix == ".json":
        data = _load_json_file(p)
        recs = data if isinstance(data, list) else data.get("data") if isinstance(data, dict) else None
        if not recs or not isinstance(recs, list) or not isinstance(recs[0], dict):
            raise DataError(f"{p}: expected a JSON list of records")
        lay = _layout_of_record(recs[0])
        if lay is None or lay == "searchr1":
            raise DataError(f"{p}: unknown JSON layout with fields {sorted(recs[0])}")
        return lay
    if suffix in (".jsonl", ".ndjson") or suffix == "":
        rec, _ = _first_json_line(p)
        lay = _layout_of_record(rec)
        if lay is None:
            raise DataError(f"{p}: unknown jsonl layout with fields {sorted(rec)}; expected HotpotQA "
                            "(question, answer, supporting_facts, context), FlashRAG (id, question, golden_answers), "
                            "MuSiQue (question, paragraphs) or a corpus (id, contents)")
        return lay
    raise DataError(f"{p}: unknown file type {suffix!r}; expected .jsonl, .json, .parquet or .txt")


# ---------------------------------------------------------------------------------------------
# QA loaders
# ---------------------------------------------------------------------------------------------
def _check(q: Question, where: str) -> Question:
    if not isinstance(q.question, str) or not q.question.strip():
        what = "empty question" if isinstance(q.question, str) else f"'question' must be a string, got " \
            f"{type(q.question).__name__}"
        raise DataError(f"{where}: {what} (id {q.id!r})")
    if not q.golden_answers:
        raise DataError(f"{where}: empty gold answer list (id {q.id!r})")
    if bad := [a for a in q.golden_answers if not isinstance(a, str)]:
        raise DataError(f"{where}: gold answers must be strings, got {type(bad[0]).__name__} {_short(bad[0], 40)} "
                        f"(id {q.id!r})")
    if max_question_chars is not None and len(q.question) > max_question_chars:
        raise DataError(f"{where}: question of {len(q.question)} characters, over the limit of {max_question_chars} "
                        f"(id {q.id!r}; raise it with --max-question-chars)")
    return q


#: Longest question (load_qa) and passage (load_corpus), characters; ``ragfast --max-question-chars``. A 50 MB
#: question took 192 s and 4.5 GB uncapped; HotpotQA questions are < 1,000, wiki-18 passages ~100 words.
max_question_chars: int | None = 4096
max_passage_chars: int | None = 100_000


def set_length_caps(question_chars: int | None = None, passage_chars: int | None = None) -> None:
    """Set the length caps (``ragfast --max-question-chars/--max-passage-chars``); None keeps one."""
    global max_question_chars, max_passage_chars
    for flag, v in (("--max-question-chars", question_chars), ("--max-passage-chars", passage_chars)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"{flag} must be an integer >= 1, got {v!r}")
    max_question_chars = max_question_chars if question_chars is None else question_chars
    max_passage_chars = max_passage_chars if passage_chars is None else passage_chars


def _check_passage_lengths(table: pa.Table, where: str) -> pa.Table:
    if max_passage_chars is None or table.num_rows == 0:
        return table
    lengths = pc.utf8_length(table.column("contents"))
    if (longest := pc.max(lengths).as_py() or 0) > max_passage_chars:
        row = pc.index(lengths, longest).as_py()
        raise DataError(f"{where}: passage {row} (id {table.column('id')[row].as_py()!r}) has {longest} characters, "
                        f"over the limit of {max_passage_chars} (raise it with --max-passage-chars)")
    return table


def _convert(conv: Any, rec: Any, where: str) -> Question:  # a record of the wrong shape: one line, no traceback
    try:
        return conv(rec, where)
    except DataError:
        raise
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
        shape = {k: type(v).__name__ for k, v in rec.items() if not isinstance(v, str)} if isinstance(rec, dict) else rec
        raise DataError(f"{where}: a field has the wrong type ({type(exc).__name__}: {_short(str(exc), 80)}; "
                        f"non-string fields: {_short(shape, 80)})") from None


def _iter_jsonl(p: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    for n, line in _text_lines(p):
        yield n, _parse_line(line, p, n)


def _req(rec: dict[str, Any], key: str, where: str) -> Any:
    if key not in rec:
        raise DataError(f"{where}: missing field {key!r}")
    return rec[key]


def _hotpot_hf(rec: dict[str, Any], where: str) -> Question:
    sf = _req(rec, "supporting_facts", where)
    ctx = _req(rec, "context", where)
    if not isinstance(ctx, dict):
        raise DataError(f"{where}: 'context' must be an object {{title, sentences}}, got {type(ctx).__name__}")
    titles = list(dict.fromkeys(sf.get("title", []))) if isinstance(sf, dict) else []
    ans = _req(rec, "answer", where)
    meta = {"context": {"title": list(ctx.get("title", [])), "sentences": [list(s) for s in ctx.get("sentences", [])]},
            "type": rec.get("type"), "level": rec.get("level"),
            "supporting_facts": {"title": list(sf.get("title", [])), "sent_id": list(sf.get("sent_id", []))}}
    golds = [ans] if ans not in (None, "") else []
    return _check(Question(str(_req(rec, "id", where)), _req(rec, "question", where), golds, titles, meta), where)


def _hotpot_orig(rec: dict[str, Any], where: str) -> Question:
    # The original HotpotQA json: supporting_facts = [[title, sent_id]], context = [[title, [sentences]]].
    sf = _req(rec, "supporting_facts", where)
    ctx = _req(rec, "context", where)
    if not isinstance(ctx, list) or not all(isinstance(c, list) and len(c) == 2 for c in ctx):
        raise DataError(f"{where}: 'context' must be an object {{title, sentences}} or [title, sentences] pairs")
    ans = _req(rec, "answer", where)
    meta = {"context": {"title": [c[0] for c in ctx], "sentences": [list(c[1]) for c in ctx]},
            "type": rec.get("type"), "level": rec.get("level"),
            "supporting_facts": {"title": [s[0] for s in sf], "sent_id": [s[1] for s in sf]}}
    qid = rec.get("_id", rec.get("id"))
    return _check(Question(str(qid), rec["question"], [ans] if ans not in (None, "") else [],
                           list(dict.fromkeys(s[0] for s in sf)), meta), where)


def _flashrag(rec: dict[str, Any], where: str) -> Question:
    golds = _req(rec, "golden_answers", where)
    if isinstance(golds, str):
        golds = [golds]
    meta = dict(rec.get("metadata") or {})
    sup = meta.get("supporting_titles") or rec.get("supporting_titles") or []
    if not sup and isinstance(meta.get("supporting_facts"), dict):
        sup = list(dict.fromkeys(meta["supporting_facts"].get("title", [])))
    return _check(Question(str(_req(rec, "id", where)), _req(rec, "question", where), [str(g) for g in golds],
                           list(sup), meta), where)


def _musique(rec: dict[str, Any], where: str) -> Question:
    paras = _req(rec, "paragraphs", where)
    ans = rec.get("answer")
    golds = ([ans] if ans not in (None, "") else []) + [a for a in rec.get("answer_aliases") or [] if a]
    sup = list(dict.fromkeys(p["title"] for p in paras if p.get("is_supporting")))
    meta = {"context": {"title": [p["title"] for p in paras], "sentences": [[p["paragraph_text"]] for p in paras]},
            "answerable": rec.get("answerable"),
            "question_decomposition": rec.get("question_decomposition")}
    return _check(Question(str(_req(rec, "id", where)), _req(rec, "question", where), list(dict.fromkeys(golds)),
                           sup, meta), where)


def _tatqa(docs: list[dict[str, Any]], p: Path) -> list[Question]:
    out = []
    for d_i, doc in enumerate(docs):
        table_uid = (doc.get("table") or {}).get("uid")
        for q in doc.get("questions", []):
            where = f"{p}: document {d_i}, question {q.get('uid')}"
            ans = q.get("answer")
            # Numbers keep their shortest round-trip text; multi-span answers list every span.
            vals = ans if isinstance(ans, list) else [ans]
            golds = [repr(v) if isinstance(v, float) else str(v) for v in vals if v not in (None, "")]
            meta = {"doc_index": d_i, "answer_from": q.get("answer_from"), "answer_type": q.get("answer_type"),
                    "scale": q.get("scale"), "table_uid": table_uid, "derivation": q.get("derivation"),
                    "rel_paragraphs": q.get("rel_paragraphs"), "answer": ans}
            out.append(_check(Question(str(_req(q, "uid", where)), _req(q, "question", where), golds, [], meta), where))
    return out


_METAQA_ENTITY = re.compile(r"\[([^\]]+)\]")


def _metaqa(p: Path) -> list[Question]:
    out = []
    for n, line in _text_lines(p):
        where = f"{p}:{n}"
        if "\t" not in line:
            raise DataError(f"{where}: expected 'question<TAB>answer1|answer2'")
        raw, ans = line.split("\t", 1)
        m = _METAQA_ENTITY.search(raw)
        meta = {"topic_entity": m.group(1) if m else None, "raw_question": raw}
        golds = [a for a in ans.split("|") if a.strip()]
        q = Question(f"{p.stem}-{n}", raw.replace("[", "").replace("]", "").strip(), golds, [], meta)
        out.append(_check(q, where))
    return out


def _prompt_question(prompt: Any) -> str:
    msgs = prompt if isinstance(prompt, list) else [prompt]
    text = ""
    for m in msgs:
        if isinstance(m, dict) and m.get("role", "user") == "user":
            text = m.get("content") or ""
        elif isinstance(m, str):
            text = m
    cut = text.rfind("Question: ")
    return (text[cut + len("Question: "):] if cut >= 0 else text).strip()


def _searchr1(p: Path) -> list[Question]:
    table = pq.read_table(p)
    out = []
    for i, rec in enumerate(table.to_pylist()):
        where = f"{p}: row {i}"
        rm = rec.get("reward_model") or {}
        target = ((rm.get("ground_truth") or {}).get("target")) if isinstance(rm, dict) else None
        if isinstance(target, str):
            target = [target]
        extra = rec.get("extra_info") or {}
        idx = extra.get("index", i)
        src = rec.get("data_source")
        question = rec.get("question") or _prompt_question(rec.get("prompt"))
        # Search-R1 mixes data sources in one file with per-source indices: prefix the source.
        qid = f"{src}_{idx}" if src else str(idx)
        meta = {"data_source": src, "split": extra.get("split"), "ability": rec.get("ability"), "index": idx}
        out.append(_check(Question(qid, question, [str(t) for t in (target or [])], [], meta), where))
    return out


def load_qa(path: str | Path, limit: int | None = None) -> list[Question]:
    """Read a QA file into :class:`~ragfast.types.Question` records.

    The layout is detected from the file: HotpotQA (Hugging Face jsonl, or the original json),
    FlashRAG jsonl (``id, question, golden_answers, metadata``), Search-R1 parquet, MuSiQue
    json/jsonl, MetaQA txt, TAT-QA raw json.

    HotpotQA and MuSiQue records carry their supporting titles (unique, in order) and
    ``metadata["context"] = {"title": [...], "sentences": [[...], ...]}``, which
    :func:`corpus_from_contexts` turns into a corpus.

    Parameters
    ----------
    path : str or Path
        A file, or a bundled sample name (e.g. ``"hotpotqa-dev"``).
    limit : int, optional
        Keep only the first ``limit`` questions.

    Raises
    ------
    DataError
        Missing file, unknown layout, a jsonl line that does not parse (file and line number),
        an empty question or an empty gold answer list.
    """
    p = _resolve(path)
    layout = detect_layout(p)
    if layout in ("corpus", "triples"):
        what = "a corpus ({id, contents} rows): use load_corpus" if layout == "corpus" else \
            "a knowledge-base triple file: use load_triples"
        raise DataError(f"{p} is {what}, not a QA file")
    if layout == "metaqa":
        qs = _metaqa(p)
    elif layout == "searchr1":
        qs = _searchr1(p)
    elif layout == "tatqa":
        data = _load_json_file(p)
        qs = _tatqa(data if isinstance(data, list) else data["data"], p)
    else:
        conv = {"hotpotqa": _hotpot_hf, "hotpotqa-orig": _hotpot_orig, "flashrag": _flashrag,
                "musique": _musique}[layout]
        if p.suffix.lower() == ".json":
            data = _load_json_file(p)
            recs = data if isinstance(data, list) else data["data"]
            qs = [_convert(conv, r, f"{p}: record {i}") for i, r in enumerate(recs)]
        elif p.suffix.lower() == ".parquet":
            qs = [_convert(conv, r, f"{p}: row {i}") for i, r in enumerate(pq.read_table(p).to_pylist())]
        else:
            qs = []
            for n, rec in _iter_jsonl(p):
                qs.append(_convert(conv, rec, f"{p}:{n}"))
                if limit is not None and len(qs) >= limit:
                    break
    seen: set[str] = set()
    for q in qs:
        if q.id in seen:
            raise DataError(f"{p}: duplicate question id {q.id!r}")
        seen.add(q.id)
    return qs[:limit] if limit is not None else qs


def load_triples(path: str | Path) -> list[tuple[str, str, str]]:
    """Read a ``head|relation|tail`` knowledge-base file (MetaQA's kb.txt) as triples.

    Raises
    ------
    DataError
        On a line without exactly three ``|``-separated fields (file and line number named).
    """
    p = _resolve(path)
    out = []
    for n, line in _text_lines(p):
        parts = line.split("|")
        if len(parts) != 3:
            raise DataError(f"{p}:{n}: expected 'head|relation|tail', got {len(parts)} fields")
        out.append((parts[0], parts[1], parts[2]))
    return out


# ---------------------------------------------------------------------------------------------
# corpus
# ---------------------------------------------------------------------------------------------
_SCHEMA = pa.schema([("id", pa.string()), ("contents", pa.string())])


def _normalise_table(t: pa.Table, where: str) -> pa.Table:
    for col in ("id", "contents"):
        if col not in t.column_names:
            raise DataError(f"{where}: corpus rows need 'id' and 'contents'; found columns {t.column_names}")
    ids, cont = t.column("id"), t.column("contents")
    if not (pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type)):
        ids = pc.cast(ids, pa.string())
    if not (pa.types.is_string(cont.type) or pa.types.is_large_string(cont.type)):
        raise DataError(f"{where}: corpus 'contents' must be strings, got {cont.type}")
    if ids.null_count or cont.null_count:
        raise DataError(f"{where}: corpus has null ids or contents")
    # Chunks are kept as read (one per JSON block): combining them would copy the whole corpus
    # (tens of GB for wiki-18), and Arrow's chunk resolver already makes row lookups O(log chunks).
    return pa.table({"id": ids, "contents": cont})


def _read_jsonl_arrow(p: Path, block_size: int) -> pa.Table:
    import pyarrow.json as pj

    read = pj.ReadOptions(block_size=block_size)
    try:
        return pj.read_json(p, read_options=read, parse_options=pj.ParseOptions(
            explicit_schema=pa.schema([("id", pa.string()), ("contents", pa.string())]),
            unexpected_field_behavior="ignore"))
    except pa.ArrowInvalid as exc:
        if "changed from" not in str(exc):
            raise
    # Numeric ids: let Arrow infer the id column, then cast to string.
    return pj.read_json(p, read_options=read, parse_options=pj.ParseOptions(
        explicit_schema=pa.schema([("contents", pa.string())]), unexpected_field_behavior="infer"))


def _read_jsonl_python(p: Path, chunk: int = 65536) -> pa.Table:
    """Line-by-line fallback that names the bad line; holds only one chunk as Python objects."""
    batches, ids, cont = [], [], []
    for n, rec in _iter_jsonl(p):
        if "id" not in rec or "contents" not in rec:
            raise DataError(f"{p}:{n}: corpus row needs 'id' and 'contents'; found {sorted(rec)}")
        if not isinstance(rec["contents"], str):
            raise DataError(f"{p}:{n}: 'contents' must be a string")
        ids.append(str(rec["id"]))
        cont.append(rec["contents"])
        if len(ids) >= chunk:
            batches.append(pa.record_batch([pa.array(ids, pa.string()), pa.array(cont, pa.string())],
                                           schema=_SCHEMA))
            ids, cont = [], []
    if ids or not batches:
        batches.append(pa.record_batch([pa.array(ids, pa.string()), pa.array(cont, pa.string())],
                                       schema=_SCHEMA))
    return pa.Table.from_batches(batches, schema=_SCHEMA)


def _title_of(contents: str) -> str:
    return contents.partition("\n")[0].strip().strip('"')


class Corpus:
    """A retrieval corpus of ``{id, contents}`` rows held in Arrow buffers.

    ``contents`` follows wiki-18: ``'"Title"\\ntext'`` (the title line keeps its quotes).
    Build one with :func:`load_corpus`, :meth:`from_rows`, :meth:`concat` or
    :func:`corpus_from_contexts`.
    """

    def __init__(self, table: pa.Table, source: str = "<memory>"):
        self._table = _normalise_table(table, source)
        self.source = source
        self._ids: list[str] | None = None
        self._index: dict[str, int] | None = None
        self._titles: list[str] | None = None
        self._id_col = self._table.column("id")
        self._contents_col = self._table.column("contents")
        if self._table.num_rows and pc.count_distinct(self._id_col).as_py() != self._table.num_rows:
            counts = pc.value_counts(self._id_col)
            dup = next(v["values"] for v in counts.to_pylist() if v["counts"] > 1)
            raise DataError(f"{source}: duplicate corpus id {dup!r}")

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_rows(cls, rows: Iterable[dict[str, Any]], source: str = "<rows>") -> "Corpus":
        """A corpus from ``{"id", "contents"}`` dicts (ids are turned into strings)."""
        ids, cont = [], []
        for i, r in enumerate(rows):
            if "id" not in r or "contents" not in r:
                raise DataError(f"{source}: row {i} needs 'id' and 'contents'; found {sorted(r)}")
            ids.append(str(r["id"]))
            cont.append(str(r["contents"]))
        return cls(pa.table({"id": pa.array(ids, pa.string()), "contents": pa.array(cont, pa.string())}),
                   source)

    @classmethod
    def concat(cls, corpora: Sequence["Corpus"]) -> "Corpus":
        """Concatenate corpora in order; their ids must stay unique (else :class:`DataError`)."""
        if not corpora:
            raise DataError("Corpus.concat needs at least one corpus")
        tables = [c._table for c in corpora]
        if len({t.schema for t in tables}) > 1:  # string vs large_string (e.g. from parquet): unify
            wide = pa.schema([("id", pa.large_string()), ("contents", pa.large_string())])
            tables = [t.cast(wide) for t in tables]
        table = pa.concat_tables(tables)
        return cls(table, " + ".join(c.source for c in corpora))

    # -- access ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._table.num_rows

    def __repr__(self) -> str:
        return f"Corpus({len(self)} passages from {self.source})"

    @property
    def table(self) -> pa.Table:
        """The underlying Arrow table (string columns ``id``, ``contents``; possibly chunked)."""
        return self._table

    @property
    def ids(self) -> list[str]:
        """All ids in row order (computed once, then cached)."""
        if self._ids is None:
            self._ids = self._id_col.to_pylist()
        return self._ids

    def _check_row(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"corpus row {i} out of range for {n} passages")
        return i % n

    def row(self, i: int) -> dict[str, str]:
        """Row ``i`` as Search-R1's retriever returns it: ``{"id", "contents"}``."""
        i = self._check_row(int(i))
        return {"id": self._id_col[i].as_py(), "contents": self._contents_col[i].as_py()}

    def passage(self, i: int) -> Passage:
        """Row ``i`` as a :class:`~ragfast.types.Passage` (title = first line, quotes kept)."""
        r = self.row(i)
        return Passage.from_contents(r["id"], r["contents"])

    def contents(self, indices: Sequence[int] | Any) -> list[str]:
        """The contents of several rows, in the order given."""
        idx = pa.array([self._check_row(int(i)) for i in indices], pa.int64())
        return self._contents_col.take(idx).to_pylist()

    def titles(self) -> list[str]:
        """Every row's title: the first line of contents without surrounding quotes (cached)."""
        if self._titles is None:
            first = pc.list_element(pc.split_pattern(self._contents_col, "\n", max_splits=1), 0)
            self._titles = pc.utf8_trim(pc.utf8_trim_whitespace(first), '"').to_pylist()
        return self._titles

    def index_of(self, id: str) -> int:
        """Row index of an id; :class:`KeyError` naming the id when it is absent."""
        if self._index is None:
            self._index = {x: i for i, x in enumerate(self.ids)}
        try:
            return self._index[str(id)]
        except KeyError:
            raise KeyError(f"corpus id {id!r} not found in {self.source}") from None

    def iter_batches(self, n: int) -> Iterator[list[str]]:
        """Contents in row order, ``n`` rows at a time (the last batch may be shorter)."""
        if n < 1:
            raise ValueError(f"iter_batches: batch size must be >= 1, got {n}")
        for start in range(0, len(self), n):
            yield self._contents_col.slice(start, n).to_pylist()

    def save(self, path: str | Path) -> Path:
        """Write the corpus as ``.jsonl`` (wiki-18 rows) or ``.parquet``."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.suffix.lower() == ".parquet":
            pq.write_table(self._table, p)
        elif p.suffix.lower() == ".arrow":  # memory-mapped by load_corpus
            write_arrow_corpus(p, self._table.to_batches(max_chunksize=1 << 20))
        elif p.suffix.lower() in (".jsonl", ".ndjson"):
            with open(p, "w", encoding="utf-8") as f:
                for batch in self._table.to_batches(max_chunksize=65536):
                    for i, c in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
                        f.write(json.dumps({"id": i, "contents": c}, ensure_ascii=False) + "\n")
        else:
            raise DataError(f"Corpus.save: unknown file type {p.suffix!r}; use .jsonl, .parquet or .arrow")
        return p


def load_corpus(path: str | Path, block_size: int = 1 << 24) -> Corpus:
    """Read a wiki-18-style corpus (``{"id", "contents"}`` jsonl, parquet or Arrow IPC) into a :class:`Corpus`.

    Rows are parsed by Arrow's multithreaded JSON reader in blocks of ``block_size`` bytes
    straight into Arrow buffers; no per-row Python object is created. A file Arrow cannot
    parse is re-read line by line to report the offending line.

    Parameters
    ----------
    path : str or Path
        A ``.jsonl``, ``.parquet`` or ``.arrow`` (memory-mapped) file, or a sample name.
    block_size : int
        Bytes per JSON parsing block (must exceed the longest line).

    Raises
    ------
    DataError
        Missing file, missing fields, a line that does not parse, duplicate ids.
    """
    p = _resolve(path)
    if p.suffix.lower() == ".arrow":  # zero-copy memory map (ragfast.data.passage_store)
        return Corpus(_check_passage_lengths(map_arrow_table(p), str(p)), str(p))
    if p.suffix.lower() == ".parquet":
        try:
            return Corpus(_check_passage_lengths(pq.read_table(p, columns=["id", "contents"]), str(p)), str(p))
        except (pa.ArrowInvalid, KeyError) as exc:
            raise DataError(f"{p}: not a corpus parquet with columns id, contents ({exc})") from None
    rec, _ = _first_json_line(p)
    if "id" not in rec or "contents" not in rec:
        raise DataError(f"{p}: not a corpus: rows need 'id' and 'contents'; the first row has {sorted(rec)}")
    try:
        table = _read_jsonl_arrow(p, block_size)
        # Arrow's JSON reader keeps bytes that are not UTF-8; they would fail at the first read of
        # the row. Checked here, and the line-by-line reader then names the line.
        for col in ("id", "contents"):
            table.column(col).validate(full=True)
    except pa.ArrowInvalid:
        table = _read_jsonl_python(p)  # raises a DataError naming the line, or succeeds on odd-but-valid input
    return Corpus(_check_passage_lengths(table, str(p)), str(p))


def corpus_from_contexts(questions: Iterable[Question] | str | Path) -> Corpus:
    """The natural corpus of HotpotQA-style questions: one passage per context paragraph.

    Each passage is ``'"Title"\\n' + "".join(sentences)`` (the wiki-18 convention; HotpotQA
    sentences carry their own leading spaces). Identical (title, text) paragraphs shared by
    several questions appear once. Ids are ``hp-0, hp-1, ...`` in first-seen order, so the same
    questions always give the same ids.

    Parameters
    ----------
    questions : iterable of Question, or a path / sample name
        Records whose ``metadata["context"]`` holds ``{"title": [...], "sentences": [[...]]}``.

    Raises
    ------
    DataError
        If a question has no context.
    """
    if isinstance(questions, (str, Path)):
        questions = load_qa(questions)
    seen: dict[tuple[str, str], int] = {}
    ids, cont = [], []
    for q in questions:
        ctx = q.metadata.get("context") if isinstance(q.metadata, dict) else None
        if not ctx or "title" not in ctx or "sentences" not in ctx:
            raise DataError(f"question {q.id!r} has no context paragraphs (metadata['context'])")
        for title, sents in zip(ctx["title"], ctx["sentences"]):
            text = "".join(sents).strip()
            key = (title, text)
            if key in seen:
                continue
            seen[key] = len(ids)
            ids.append(f"hp-{len(ids)}")
            cont.append(f'"{title}"\n{text}')
    return Corpus(pa.table({"id": pa.array(ids, pa.string()), "contents": pa.array(cont, pa.string())}),
                  "contexts")


# ---------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------
def _short(v: Any, n: int = 160) -> str:
    s = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str)
    return s if len(s) <= n else s[: n - 1] + "…"


def inspect(path: str | Path, console: Any = None) -> dict[str, Any]:
    """Print counts, fields and one sample record of a data file (QA, corpus or triples).

    Parameters
    ----------
    path : str or Path
        A data file or a sample name.
    console : rich.console.Console, optional
        Where to print (stdout by default).

    Returns
    -------
    dict
        ``{"path", "layout", "count", "fields", "sample"}``, as printed.
    """
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    p = _resolve(path)
    layout = detect_layout(p)
    if layout == "corpus":
        c = load_corpus(p)
        count, fields = len(c), ["id", "contents"]
        first = c.row(0) if len(c) else {}
        extra = {"unique titles": len(set(c.titles()))}
    elif layout == "triples":
        tr = load_triples(p)
        count, fields = len(tr), ["head", "relation", "tail"]
        first = dict(zip(fields, tr[0])) if tr else {}
        extra = {"relations": len({r for _, r, _ in tr}),
                 "entities": len({h for h, _, _ in tr} | {t for _, _, t in tr})}
    else:
        qs = load_qa(p)
        count = len(qs)
        first = qs[0].to_dict() if qs else {}
        fields = list(first) + [f"metadata.{k}" for k in (qs[0].metadata if qs else {})]
        with_sup = sum(1 for q in qs if q.supporting_titles)
        extra = {"with supporting titles": with_sup,
                 "gold answers / question": round(sum(len(q.golden_answers) for q in qs) / max(count, 1), 2)}
        if first and "context" in first.get("metadata", {}):
            first = dict(first)
            first["metadata"] = {k: v for k, v in first["metadata"].items() if k != "context"}
            first["metadata"]["context"] = f"<{len(qs[0].metadata['context']['title'])} paragraphs>"
    t = Table(title=f"{p.name}  ({layout})", show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value")
    t.add_row("path", str(p))
    t.add_row("records", str(count))
    for k, v in extra.items():
        t.add_row(k, str(v))
    t.add_row("fields", ", ".join(fields))
    for k, v in first.items():
        t.add_row(f"sample.{k}", _short(v))
    con.print(t)
    return {"path": str(p), "layout": layout, "count": count, "fields": fields, "sample": first}
