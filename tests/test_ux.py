"""What a person sees: progress lines, logging, slot verdicts, shipped embeddings."""
import io
import json
import logging
import warnings

import numpy as np
import pytest

from ragfast.infra.progress import RunProgress, current, progress_task
from ragfast.methods.s2g.doc_count import MIN_POSITIVES, doc_count_scores, judge_vs_doc_count
from ragfast.outputs.slot_labels import ORACLE_LABEL


def test_plain_progress_lines_when_not_a_terminal(capsys):
    from rich.console import Console

    con = Console(file=io.StringIO(), force_terminal=False, stderr=True)
    with RunProgress(con, interval=0.0) as prog:
        assert current() is prog and prog.plain
        # a nested caller joins the active display instead of opening its own
        with progress_task("embedding x", 10, unit="passages") as t:
            t.advance(4)
            t.set_status("turn 2 · 3 active")
            t.advance(6)
    assert current() is None
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("[progress] embedding x: 0/10 passages (0%)")
    assert any("4/10 passages (40%)" in x and "turn 2" not in x for x in err)
    assert any("turn 2 · 3 active" in x for x in err)
    assert err[-1].startswith("[progress] embedding x: 10/10 passages (100%)") and err[-1].endswith("done")


def test_disabled_task_counts_silently(capsys):
    with progress_task("quiet", 5, enabled=False) as t:
        t.advance(5)
    assert t.completed == 5 and capsys.readouterr().err == ""


def test_doc_count_baseline_and_verdicts():
    g = np.array([0, 0, 0, 1, 2, 2])
    assert doc_count_scores(g).tolist() == [0, 1, 2, 0, 0, 1]  # the state index: searches made before it
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(80), 4)
    t = np.tile(np.arange(1, 5), 80)
    # labels follow the document count exactly: a judge scoring the count ties it, noise loses to it
    labels = (t >= 3).astype(int)
    same = judge_vs_doc_count(t.astype(float), labels, groups, n_resamples=200)
    assert same is not None and not same.meaningful and "no better than counting documents" in same.label
    noise = judge_vs_doc_count(rng.normal(size=t.size), labels, groups, n_resamples=200)
    assert not noise.meaningful and noise.label.startswith("NO: worse than counting documents")
    # labels the count cannot see, which a judge sees
    hidden = rng.integers(0, 2, size=t.size)
    good = judge_vs_doc_count(hidden + 0.1 * rng.normal(size=t.size), hidden, groups, n_resamples=200)
    assert good.meaningful and good.label.startswith("yes") and good.low > 0
    nm = judge_vs_doc_count(t.astype(float), np.zeros_like(t), groups)
    assert not nm.measured and not nm.meaningful and nm.label.startswith("too few positives: not measured")
    assert judge_vs_doc_count(np.zeros(0), np.zeros(0, int), np.zeros(0, int)) is None


def _stop_ap_oracle(y, s):
    """The study's stop AP, by hand: sort by score, ties in input order, precision at each positive."""
    order = sorted(range(len(s)), key=lambda i: (-s[i], i))
    hits, total = 0, 0.0
    for rank, i in enumerate(order, 1):
        if y[i]:
            hits += 1
            total += hits / rank
    return total / hits if hits else 0.0


def test_judge_verdict_uses_the_stop_ap_and_needs_five_positives():
    from sklearn.metrics import average_precision_score

    # 8 questions with 3 states each; ties in the judge's scores put a negative before a positive
    groups = np.repeat(np.arange(8), 3)
    y = np.array([1, 0, 0] * 3 + [0, 1, 0] * 3 + [0, 0, 1] * 2)
    s = np.array([0.9, 0.9, 0.1] * 3 + [0.5, 0.9, 0.1] * 3 + [0.9, 0.1, 0.9] * 2)
    v = judge_vs_doc_count(s, y, groups, n_resamples=100)
    assert v.measured and v.n_positives == 8 and v.n_questions == 8 and v.n_states == 24
    assert v.judge_ap == pytest.approx(_stop_ap_oracle(y, s), abs=1e-12)
    base = np.tile([0.0, 1.0, 2.0], 8)
    assert v.doc_count_ap == pytest.approx(_stop_ap_oracle(y, base), abs=1e-12)
    # the merged-tie (sklearn) AP beside it, named as such, and here it differs
    assert v.judge_ap_merged_ties == pytest.approx(average_precision_score(y, s), abs=1e-12)
    assert v.doc_count_ap_merged_ties == pytest.approx(average_precision_score(y, base), abs=1e-12)
    assert abs(v.judge_ap - v.judge_ap_merged_ties) > 0.01
    assert "stop AP" in v.label and "8 positives" in v.label
    # fewer than MIN_POSITIVES (5) positive states: no verdict, said so; 5: measured
    assert MIN_POSITIVES == 5
    y4 = np.zeros(24, int)
    y4[[0, 3, 6, 9]] = 1
    v4 = judge_vs_doc_count(s, y4, groups, n_resamples=50)
    assert not v4.measured and not v4.meaningful and np.isnan(v4.judge_ap)
    assert v4.label == ("too few positives: not measured (4 positive of 24 validation states; a verdict needs 5)")
    y4[12] = 1
    assert judge_vs_doc_count(s, y4, groups, n_resamples=50).measured
    allpos = judge_vs_doc_count(s, np.ones(24, int), groups)
    assert not allpos.measured and allpos.label.startswith("no negative state: not measured")


def test_slot_labels_say_what_the_slot_is():
    from ragfast.models.scripted import ScriptedGenerator
    from ragfast.outputs.results import answers_label, slot_entry

    assert slot_entry(ScriptedGenerator())["answers_meaningful"] == ORACLE_LABEL
    assert "random weights" in answers_label({"meaningful": False, "note": "random-weight tiny model"})
    assert answers_label({"meaningful": True, "verdict": "NO: no better than counting documents"}).startswith("NO")


def test_logging_setup_file_and_third_party(tmp_path, capsys):
    from ragfast.infra import logs

    root = logging.getLogger()
    before = list(root.handlers)
    try:
        logs.setup(verbose=0, quiet=False)
        logging.getLogger("ragfast.test").info("own message before the file")
        logging.getLogger("matplotlib.font_manager").warning("third-party chatter")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a library warning", UserWarning)
        path = logs.attach_log_file(tmp_path)
        logging.getLogger("ragfast.test").debug("debug goes to the file only")
        for h in root.handlers:
            h.flush()
        text = path.read_text()
        assert "own message before the file" in text and "third-party chatter" in text
        assert "a library warning" in text and "debug goes to the file only" in text
        err = capsys.readouterr().err
        assert "own message before the file" in err
        assert "third-party chatter" not in err and "a library warning" not in err and "debug goes" not in err
    finally:
        logging.captureWarnings(False)
        for h in list(root.handlers):
            if h not in before:
                root.removeHandler(h)
                h.close()


def test_shipped_embeddings_are_checked(tmp_path, minilm_encoder):
    from ragfast.retrieval import shipped

    enc = minilm_encoder
    texts = ['"A"\nThe Eiffel Tower is in Paris.', '"B"\nMount Everest is the highest mountain.']
    npz = shipped.build(enc, texts, root=tmp_path)
    got = shipped.lookup(enc, texts[::-1], root=tmp_path)
    fresh = enc.encode_passages(texts[::-1]).numpy()
    assert got.dtype == np.float32 and np.abs(got - fresh).max() < 2e-3  # fp16 storage
    assert shipped.lookup(enc, texts + ["not shipped"], root=tmp_path) is None
    # another encoder identity: refused
    meta = json.loads(npz.with_suffix(".json").read_text())
    meta["identity"]["max_length"] = 17
    npz.with_suffix(".json").write_text(json.dumps(meta))
    assert shipped.lookup(enc, texts, root=tmp_path) is None
    meta["identity"] = shipped.encoder_identity(enc)
    npz.with_suffix(".json").write_text(json.dumps(meta))
    assert shipped.lookup(enc, texts, root=tmp_path) is not None
    # a damaged file: refused
    data = bytearray(npz.read_bytes())
    data[-3] ^= 0xFF
    npz.write_bytes(bytes(data))
    assert shipped.lookup(enc, texts, root=tmp_path) is None


def test_bundled_corpus_ships_its_vectors(minilm_encoder):
    from ragfast.data import corpus_from_contexts, load_corpus
    from ragfast.retrieval import shipped

    if not (shipped.shipped_dir() / "minilm.npz").exists():
        pytest.fail("ragfast/samples/embeddings/minilm.npz is missing: run python -m ragfast.retrieval.shipped")
    enc = minilm_encoder
    wiki = load_corpus("wiki-sample")
    ctx = corpus_from_contexts("hotpotqa-dev")
    for corpus in (wiki, ctx):
        texts = corpus.contents(range(len(corpus)))
        got = shipped.lookup(enc, texts)
        assert got is not None and got.shape == (len(corpus), enc.dim)
        sample = [0, len(corpus) // 2, len(corpus) - 1]
        fresh = enc.encode_passages([texts[i] for i in sample]).numpy()
        assert np.abs(got[sample] - fresh).max() < 2e-3


def _walk(cmd, path=()):
    # typer may vendor its own click: go by the interface, not by click's classes
    yield path, cmd
    if hasattr(cmd, "list_commands"):
        ctx = type(cmd).context_class(cmd) if hasattr(type(cmd), "context_class") else None
        for name in cmd.list_commands(ctx):
            yield from _walk(cmd.get_command(ctx, name), path + (name,))


def test_every_cli_option_has_help_and_booleans_are_flag_pairs():
    import typer

    from ragfast.cli import app

    missing, single_resume = [], []
    n = 0
    for path, cmd in _walk(typer.main.get_command(app)):
        for p in cmd.params:
            if p.param_type_name != "option":
                continue
            n += 1
            if not p.help and "--help" not in p.opts:
                missing.append(f"ragfast {' '.join(path)} {p.opts[0]}")
            if "--resume" in p.opts and "--no-resume" not in p.secondary_opts:
                single_resume.append(" ".join(path))
    assert n > 100  # the walk reached the sub-commands
    assert not missing, "options without help text:\n" + "\n".join(missing)
    assert not single_resume, single_resume


def test_flags_do_not_show_a_value_type_in_help():
    from typer.testing import CliRunner

    from ragfast.cli import app

    res = CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "160"}, terminal_width=160)
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if "--resume" in ln)
    assert "--no-resume" in line and "<bool>" not in line, line
    assert "--val-limit" in res.output


def test_export_accepts_tiny(tmp_path):
    """`tiny` names a model wherever a model path is taken, `ragfast export nli` included."""
    from typer.testing import CliRunner

    from ragfast.cli import app

    res = CliRunner().invoke(app, ["export", "nli", "tiny", str(tmp_path / "nli"), "--max-length", "64"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output[res.output.index("{"):])
    assert info["onnx"].endswith(".onnx") and info["task"] == "sequence-classification"
