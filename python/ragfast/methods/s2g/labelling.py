"""Label the recorded states of a native run: answer-only probe, gold support, a teacher LLM.

``ragfast label-states RESULTS_DIR`` reads the native trajectories of a finished run (a
``ragfast study s2g`` directory: ``native.jsonl`` + ``states.jsonl``; or a ``ragfast bench``
directory: ``trajectories/searchr1.jsonl``) and labels every state the live judge sees (states
1..S of each trajectory) with each requested source:

- ``probe``: the answer-only probe from the state is exactly right (``states.jsonl``'s
  ``probe_em``, recorded by ``study s2g``);
- ``gold``: every supporting title of the question is among the passages retrieved so far
  (:func:`ragfast.scoring.metrics.sufficient`; needs data with supporting facts);
- ``teacher``: an LLM asked for the judge's JSON verdict (the S2G prompt and schema of
  :mod:`ragfast.judges.causal`): a local causal-LM directory (greedy, forced ``{"sufficient":``
  prefix) or an OpenAI-compatible ``/v1/chat/completions`` URL. Unparseable verdicts are
  counted and left unlabelled (``null``), never guessed.

The output (``labelled_states.jsonl``) holds one line per state with its question, evidence,
labels and each label's provenance; the summary (``labelled_states.summary.json``) counts
positives per source, teacher parse failures, and the pairwise agreement (rate and Cohen's
kappa) of every two sources over the states both labelled.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ragfast.errors import ConfigError, DataError, ModelError
from ragfast.judges.train.labelled import LabelledState, load_labelled_states
from ragfast.types import State, Trajectory

__all__ = ["LabelledState", "native_trajectories", "gold_labels", "probe_labels", "ChatTeacher", "teacher_labels",
           "agreement", "label_states", "load_labelled_states", "SOURCES"]

SOURCES = ("probe", "gold", "teacher")


def native_trajectories(results_dir: str | Path) -> tuple[list[Trajectory], Path]:
    """The native trajectories of a ``study s2g`` or ``bench`` results directory, and their file."""
    from ragfast.outputs.results import read_results

    d = Path(results_dir)
    if not d.is_dir():
        raise DataError(f"{d} is not a directory")
    for cand in (d / "native.jsonl", d / "trajectories" / "searchr1.jsonl"):
        if cand.exists():
            recs = read_results(cand)
            if not recs:
                raise DataError(f"{cand} holds no trajectories")
            return [Trajectory.from_dict(r) for r in recs], cand
    raise DataError(f"{d} has neither native.jsonl (ragfast study s2g) nor trajectories/searchr1.jsonl (ragfast bench)")


def _states_of(trs: Sequence[Trajectory], split: dict[str, str]) -> list[LabelledState]:
    out = []
    for tr in trs:
        titles: list[str] = []
        n = 0
        ev: list[str] = []
        for t in tr.turns:
            if t.action != "search":
                continue
            n += 1
            ev = ev + [t.observation]
            titles = titles + list(t.retrieved_titles)
            out.append(LabelledState(tr.id, n, tr.question, list(ev), list(titles), split.get(tr.id, "test")))
    return out


def gold_labels(states: Sequence[LabelledState], trajectories: Sequence[Trajectory]) -> int:
    """Label each state gold-sufficient iff every supporting title is retrieved; returns how many got a label."""
    from ragfast.scoring.metrics import sufficient

    sup = {tr.id: tr.supporting_titles for tr in trajectories}
    if not any(sup.values()):
        raise DataError("no trajectory carries supporting titles: the gold source needs data with supporting facts")
    n = 0
    for s in states:
        st = sup.get(s.id) or []
        if not st:
            s.labels["gold"] = None
            s.provenance["gold"] = {"why": "question has no supporting titles"}
            continue
        s.labels["gold"] = int(sufficient(s.retrieved_titles, st))
        s.provenance["gold"] = {"rule": "all supporting titles retrieved", "supporting_titles": list(st)}
        n += 1
    return n


def probe_labels(states: Sequence[LabelledState], states_file: str | Path) -> int:
    """Copy the answer-only probe's EM from a ``states.jsonl`` (``study s2g``); returns how many got a label."""
    p = Path(states_file)
    if not p.exists():
        raise DataError(f"the probe source needs {p} (written by `ragfast study s2g`); a bench directory has no "
                        "recorded probes")
    rec = {}
    for line in p.read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            rec[str(r["id"])] = r
    n = 0
    for s in states:
        r = rec.get(s.id)
        if r is None or s.state >= len(r["probe_em"]):
            s.labels["probe"] = None
            s.provenance["probe"] = {"why": "state not in states.jsonl"}
            continue
        s.labels["probe"] = int(float(r["probe_em"][s.state]) > 0.5)
        s.provenance["probe"] = {"rule": "answer-only probe from the state has EM 1", "file": p.name,
                                 "answer": r["probe_answers"][s.state]}
        n += 1
    return n


class ChatTeacher:
    """An OpenAI-compatible ``/v1/chat/completions`` teacher asked for the judge's JSON verdict.

    Parameters
    ----------
    base_url : str
        ``http(s)://host:port`` (``/v1`` is added when missing).
    model : str
        Model name sent in the request.
    api_key : str, optional
    max_tokens : int
        Verdict budget.
    concurrency, timeout, retries
        HTTP client settings.
    """

    def __init__(self, base_url: str, model: str = "teacher", api_key: str | None = None, *, max_tokens: int = 256,
                 concurrency: int = 8, timeout: float = 300.0, retries: int = 2):
        import httpx

        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"teacher URL must start with http:// or https://, got {base_url!r}")
        url = base_url.rstrip("/")
        self.base_url = url if url.endswith("/v1") else url + "/v1"
        self.model = model
        self.max_tokens = int(max_tokens)
        self.concurrency = int(concurrency)
        self.retries = int(retries)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=timeout, headers=headers,
                                    limits=httpx.Limits(max_connections=self.concurrency))
        self._httpx = httpx
        self.name = f"{model} @ {self.base_url}"

    def _ask(self, state: State) -> str:
        from ragfast.judges.prompt import SYSTEM_PROMPT, user_text

        body = {"model": self.model, "temperature": 0.0, "max_tokens": self.max_tokens,
                "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_text(state)}]}
        # The shared client call: retries, bounded waits (--call-timeout/--total-timeout), one-line errors.
        from ragfast.infra.http import post_json

        url = self.base_url + "/chat/completions"
        data = post_json(self._client, url, body, retries=self.retries, error=ModelError)
        try:
            return str(data["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError):
            raise ModelError(f"{url}: not a chat completion: {str(data)[:300]}") from None

    def verdict_texts(self, states: Sequence[State]) -> list[str]:
        """The raw reply per state (requests run ``concurrency`` at a time)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.concurrency) as ex:
            return list(ex.map(self._ask, states))

    def close(self) -> None:
        self._client.close()


TEACHER_ROUTES = ("auto", "generate", "score")


def teacher_labels(states: Sequence[LabelledState], teacher: str, *, model: str = "teacher",
                   api_key: str | None = None, max_new_tokens: int = 256, device: str = "cpu", route: str = "auto",
                   log: Callable[[str], None] = lambda m: None) -> dict[str, int]:
    """Label states with a teacher LLM; returns counts (strict/lenient/failed parses, scored states).

    Parameters
    ----------
    teacher : str
        An ``http(s)://`` URL (chat completions), a catalogue model (``smollm2``) or a local
        causal-LM directory.
    route : {"auto", "generate", "score"}
        How a local model gives its verdict. ``generate``: the full JSON verdict, greedy
        (:meth:`~ragfast.judges.causal.CausalJudge.verdicts`); a failed parse leaves the
        state unlabelled. ``score``: the verdict token alone, constrained to true/false: the
        label is ``log P(true) > log P(false)`` after the forced ``{"sufficient":`` prefix (one
        packed forward per trajectory, nothing to parse). ``auto``: generate, then score the
        states whose verdict failed to parse, so a small model still labels every state and its
        parse failures stay counted. A URL teacher always generates.
    """
    from ragfast.models.hub import local_model
    from ragfast.judges.causal import CausalJudge
    from ragfast.judges.prompt import ANSWER_PREFIX, parse_verdict

    if route not in TEACHER_ROUTES:
        raise ConfigError(f"teacher route must be one of {', '.join(TEACHER_ROUTES)}; got {route!r}")
    sts = [s.to_state() for s in states]
    scored = None
    if teacher.startswith(("http://", "https://")):
        client = ChatTeacher(teacher, model, api_key, max_tokens=max_new_tokens)
        try:
            texts = client.verdict_texts(sts)
        finally:
            client.close()
        verdicts = []
        for t in texts:
            # A chat model may or may not repeat the prefix; parse as it came, then with it.
            v = parse_verdict(t)
            if v.parse == "failed" and not t.lstrip().startswith("{"):
                v2 = parse_verdict(ANSWER_PREFIX + t)
                v = v2 if v2.parse != "failed" else v
            verdicts.append(v)
        name = client.name
    else:
        resolved = local_model(teacher, "teacher")
        p = Path(resolved).expanduser()
        if not (p.is_dir() and (p / "config.json").exists()):
            raise ConfigError(f"teacher {teacher!r}: expected an http(s):// URL, a catalogue model (ragfast models "
                              "list) or a causal-LM directory with config.json")
        judge = CausalJudge(p, device=device)
        name = teacher if resolved != teacher else str(p)
        verdicts = judge.verdicts(sts, max_new_tokens=max_new_tokens) if route != "score" else [None] * len(sts)
        todo = [i for i, v in enumerate(verdicts) if v is None or v.parse == "failed"]
        if route != "generate" and todo:
            scored = dict(zip(todo, judge.stop_scores([sts[i] for i in todo]).tolist()))
    counts = {"strict": 0, "lenient": 0, "failed": 0, "scored": 0}
    for i, (s, v) in enumerate(zip(states, verdicts)):
        prov: dict[str, Any] = {"model": name}
        if v is not None:
            counts[v.parse] += 1
            s.labels["teacher"] = None if v.parse == "failed" else int(v.sufficient)
            prov.update(parse=v.parse, raw=v.raw[:2000], gap_items=v.gap_items, **({"error": v.error} if v.error else {}))
        if scored is not None and i in scored:
            sc = scored[i]
            # A state the model cannot score (NaN) stays unlabelled, as a failed parse does.
            s.labels["teacher"] = None if sc != sc else int(sc > 0.0)
            counts["scored"] += sc == sc
            prov.update(route="score", score=sc)
        s.provenance["teacher"] = prov
    log(f"teacher {name}: {counts['strict']} strict, {counts['lenient']} lenient, {counts['failed']} failed parses, "
        f"{counts['scored']} labelled by the true/false score")
    return counts


def agreement(states: Sequence[LabelledState], sources: Sequence[str]) -> dict[str, Any]:
    """Pairwise agreement of label sources over the states both labelled: rate and Cohen's kappa."""
    out = {}
    for i, a in enumerate(sources):
        for b in sources[i + 1:]:
            pairs = np.array([(s.labels[a], s.labels[b]) for s in states
                              if s.labels.get(a) is not None and s.labels.get(b) is not None], dtype=float)
            if pairs.size == 0:
                out[f"{a}~{b}"] = {"n": 0, "agreement": None, "kappa": None}
                continue
            x, y = pairs[:, 0], pairs[:, 1]
            po = float((x == y).mean())
            pe = float(x.mean() * y.mean() + (1 - x.mean()) * (1 - y.mean()))
            kappa = None if pe >= 1.0 else (po - pe) / (1.0 - pe)
            out[f"{a}~{b}"] = {"n": int(len(x)), "agreement": po, "kappa": kappa,
                               "both_positive": int(((x == 1) & (y == 1)).sum()),
                               f"only_{a}": int(((x == 1) & (y == 0)).sum()), f"only_{b}": int(((x == 0) & (y == 1)).sum())}
    return out


def label_states(results_dir: str | Path, sources: Sequence[str], *, teacher: str | None = None,
                 teacher_model: str = "teacher", api_key: str | None = None, out: str | Path | None = None,
                 max_new_tokens: int = 256, device: str = "cpu", teacher_route: str = "auto",
                 log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Label the recorded states of a native run; write the labelled-state file and its summary.

    Parameters
    ----------
    results_dir : str or Path
        A ``study s2g`` or ``bench`` results directory.
    sources : sequence of {"probe", "gold", "teacher"}
    teacher : str, optional
        URL, catalogue model or causal-LM directory (required with the ``teacher`` source).
    teacher_route : {"auto", "generate", "score"}
        How a local teacher answers (:func:`teacher_labels`).
    out : str or Path, optional
        Output file (default ``RESULTS_DIR/labelled_states.jsonl``); the summary is written
        beside it as ``<stem>.summary.json``.

    Returns
    -------
    dict
        The summary.
    """
    src = list(dict.fromkeys(sources))
    bad = [s for s in src if s not in SOURCES]
    if not src or bad:
        raise ConfigError(f"label sources must be among {', '.join(SOURCES)}; got {', '.join(src) or 'none'}")
    if "teacher" in src and not teacher:
        raise ConfigError("the teacher source needs --teacher URL|PATH")
    d = Path(results_dir)
    trs, traj_file = native_trajectories(d)
    split = {}
    if (d / "states.jsonl").exists():
        for line in (d / "states.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                split[str(r["id"])] = r.get("split", "test")
    states = _states_of(trs, split)
    if not states:
        raise DataError(f"{traj_file}: no trajectory made a search; there are no states to label")
    t0 = time.perf_counter()
    summary: dict[str, Any] = {"results_dir": str(d), "trajectories": traj_file.name, "n_questions": len(trs),
                               "n_states": len(states), "sources": {}}
    for s in src:
        if s == "probe":
            n = probe_labels(states, d / "states.jsonl")
            summary["sources"]["probe"] = {"labelled": n}
        elif s == "gold":
            n = gold_labels(states, trs)
            summary["sources"]["gold"] = {"labelled": n}
        else:
            counts = teacher_labels(states, str(teacher), model=teacher_model, api_key=api_key,
                                    max_new_tokens=max_new_tokens, device=device, route=teacher_route, log=log)
            summary["sources"]["teacher"] = {"labelled": sum(st.labels.get("teacher") is not None for st in states),
                                             "teacher": teacher, "route": teacher_route, "parse": counts,
                                             "parse_failures": counts["failed"], "scored": counts["scored"]}
        labs = [st.labels.get(s) for st in states if st.labels.get(s) is not None]
        summary["sources"][s]["positives"] = int(sum(labs))
        summary["sources"][s]["positive_rate"] = float(np.mean(labs)) if labs else None
        log(f"{s}: {len(labs)} states labelled, {int(sum(labs))} sufficient")
    if len(src) > 1:
        summary["agreement"] = agreement(states, src)
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    path = Path(out) if out is not None else d / "labelled_states.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for s in states:
            f.write(json.dumps(s.to_dict(), ensure_ascii=False) + "\n")
    tmp.replace(path)
    summary["file"] = str(path)
    path.with_name(path.stem + ".summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary
