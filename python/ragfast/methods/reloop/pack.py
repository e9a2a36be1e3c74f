"""The canonical evidence pack: read segments with provenance pointers, and following a pointer back."""
from __future__ import annotations

from typing import Any, Sequence

from ragfast.errors import DataError
from ragfast.methods.reloop.workspace import Workspace

__all__ = ["canonicalise", "item_view", "resolve_provenance"]


def canonicalise(ws: Workspace, selected: Sequence[int], context: Sequence[int] = ()) -> list[dict[str, Any]]:
    """Pack the read segments with provenance, in read order (context rows after their reader).

    Each item: ``rank``, ``segment_id``, ``doc_id``, ``kind`` (text / cell), ``snippet`` (the
    exact source text) and the pointer: ``start``/``end`` char offsets into the document text
    (text; for a TAT-QA paragraph sentence, into that paragraph, with ``para_index``) or
    ``row``/``col`` plus headers (cell). :func:`resolve_provenance` follows the pointer.
    """
    seq = ws.seq
    rows = [int(ws.cand[p]) for p in selected] + [int(r) for r in context]
    items = []
    for rank, r in enumerate(rows, 1):
        src = seq.sources[int(seq.doc[r])]
        item: dict[str, Any] = {"rank": rank, "segment_id": seq.ids[r], "doc_id": src["id"],
                                "snippet": seq.contents[r], "role": "read" if rank <= len(selected) else "context"}
        lvl = seq.level_name(r)
        if lvl == "cell":
            m = seq.meta[r]
            item.update(kind="cell", row=int(seq.row[r]), col=int(seq.col[r]), row_header=m["row_header"],
                        col_header=m["col_header"])
        else:
            item.update(kind="text", start=int(seq.start[r]), end=int(seq.end[r]))
            if ws.kind == "tatqa":
                item["para_index"] = int(seq.meta[r]["para_index"])
            else:
                item["title"] = src["title"]
        items.append(item)
    return items


def item_view(item: dict[str, Any]) -> str:
    """The text a pack item was read (and budgeted) as: "title: sentence" or "row | column: value"."""
    if item["kind"] == "cell":
        return f"{item['row_header']} | {item['col_header']}: {item['snippet'].strip()}"
    if item["kind"] == "text" and "title" in item:
        return f"{item['title']}: {item['snippet'].strip()}"
    if item["kind"] == "triple":
        return item["snippet"].replace("|", " ")
    return item["snippet"].strip()


def resolve_provenance(item: dict[str, Any], source: Any) -> str:
    """Follow one pack item's pointer into its rebuilt source (:func:`ragfast.methods.reloop.hseq.to_source`).

    Returns the exact source text the pointer names; tests compare it with ``item["snippet"]``.
    """
    kind = item.get("kind")
    if kind == "text":
        if "para_index" in item:
            return source["paragraphs"][item["para_index"]]["text"][item["start"]:item["end"]]
        return source["text"][item["start"]:item["end"]]
    if kind == "cell":
        return source["table"]["table"][item["row"]][item["col"]]
    if kind == "triple":
        h, r, t = source[item["triple_index"]]
        return f"{h}|{r}|{t}"
    raise DataError(f"unknown provenance kind {kind!r}")
