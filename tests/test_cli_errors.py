"""Bad input on the command line: exit status 2, one ``error:`` line, and nothing left on disk."""
import json
import socket
import subprocess
import sys
import textwrap

import pytest

from ragfast.errors import ConfigError
from ragfast.outputs.outdir import output_dir


def _cli(args, cwd, pre=""):
    """Run ``ragfast ARGS`` in a fresh interpreter (``pre``: Python run first, e.g. hiding a package)."""
    code = textwrap.dedent(f"""
        import sys
        {pre}
        sys.argv = ["ragfast"] + {list(args)!r}
        from ragfast.cli import main
        main()
    """)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: nothing listens there


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _qa(path, ids):
    path.write_text("".join(json.dumps({"id": i, "question": f"question {n}?", "golden_answers": ["x"]}) + "\n"
                            for n, i in enumerate(ids)))


CASES = {
    "out is a file": (["run", "searchr1", "--offset", "0", "--model", "scripted", "--data", "qa.jsonl", "--out", "taken.txt",
                       "--retriever", "bm25", "--no-progress"], "", "taken.txt exists and is not a directory"),
    "index out is a file": (["index", "build", "--corpus", "wiki-sample", "--encoder", "bm25", "--out", "taken.txt"],
                            "", "taken.txt exists and is not a directory"),
    "unreachable retriever": (["run", "searchr1", "--offset", "0", "--model", "scripted", "--data", "qa.jsonl", "--out", "new/run",
                               "--retriever", "http://127.0.0.1:{port}", "--no-progress"], "", "cannot reach"),
    "offset past the data": (["run", "stepgap", "--model", "scripted", "--data", "qa.jsonl", "--offset", "99",
                              "--out", "new", "--retriever", "bm25", "--no-progress"], "", "--offset 99 is past the"),
    "unreachable unnamed served model": (["run", "stepgap", "--offset", "0", "--model", "http://127.0.0.1:{port}/v1",
                                          "--data", "qa.jsonl", "--out", "new", "--retriever", "bm25", "--no-progress"],
                                         "",
                                         "cannot reach the reasoner server"),
    "unreachable served model": (["run", "searchr1", "--offset", "0", "--model", "http://127.0.0.1:{port}/v1", "--served-model", "m",
                                  "--data", "qa.jsonl", "--out", "new", "--retriever", "bm25", "--no-progress"], "",
                                 "cannot reach the reasoner server"),
    "duplicate ids": (["run", "searchr1", "--offset", "0", "--model", "scripted", "--data", "dup.jsonl", "--out", "new",
                       "--retriever", "bm25", "--no-progress"], "", "duplicate question id"),
    "bad json": (["run", "searchr1", "--offset", "0", "--model", "scripted", "--data", "bad.jsonl", "--out", "new",
                  "--no-progress"], "", "bad.jsonl:2"),
    "train-judge without scikit-learn": (["train-judge", "--out", "judge"], "sys.modules['sklearn'] = None",
                                         "pip install 'ragfast[train]'"),
    "train-reasoner unknown base": (["train-reasoner", "--out", "new", "--base", "no-such-model"], "",
                                    "'no-such-model' is neither a catalogue model nor a local model directory"),
    "eval-reasoner not a run": (["eval-reasoner", "--search", "taken.txt", "--closed", "taken.txt"], "",
                                "not a `ragfast run searchr1` output directory"),
    "missing extra": (["serve-retriever", "--corpus", "wiki-sample", "--encoder", "bm25"],
                      "sys.modules['uvicorn'] = None", "pip install 'ragfast[serve]'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_with_one_line_and_leaves_nothing(case, tmp_path):
    args, pre, words = CASES[case]
    port = _closed_port()
    args = [a.replace("{port}", str(port)) for a in args]
    (tmp_path / "taken.txt").write_text("precious\n")
    _qa(tmp_path / "qa.jsonl", ["a", "b"])
    _qa(tmp_path / "dup.jsonl", ["a", "a"])
    (tmp_path / "bad.jsonl").write_text('{"id": "a", "question": "q?", "golden_answers": ["x"]}\n{"id": "b", "que\n')
    before = _tree(tmp_path)
    p = _cli(args, tmp_path, pre)
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], p.stderr
    assert "Traceback" not in p.stderr and "at at" not in p.stderr
    assert _tree(tmp_path) == before  # created nothing, touched nothing
    assert (tmp_path / "taken.txt").read_text() == "precious\n"


def test_output_dir_tidies_only_what_a_failed_command_made(tmp_path):
    out = tmp_path / "a" / "b"
    with pytest.raises(RuntimeError):
        with output_dir(out):
            out.mkdir(parents=True, exist_ok=True)  # output_dir made it already, to lock it
            (out / "manifest.json").write_text("{}")
            (out / "results.jsonl").write_text("")
            raise RuntimeError("server went away")
    assert not (tmp_path / "a").exists()  # the parents it made went too
    # A directory that was there keeps what it held; only the new metadata goes.
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    (keep / "empty_sub").mkdir()
    with pytest.raises(KeyboardInterrupt):
        with output_dir(keep):
            (keep / "manifest.json").write_text("{}")
            (keep / "chunks").mkdir()
            raise KeyboardInterrupt
    assert _tree(keep) == ["empty_sub", "notes.txt"]
    # Finished work is never thrown away.
    with pytest.raises(RuntimeError):
        with output_dir(keep):
            (keep / "manifest.json").write_text("{}")
            (keep / "results.jsonl").write_text('{"id": "a"}\n')
            raise RuntimeError("later failure")
    assert (keep / "results.jsonl").read_text() == '{"id": "a"}\n' and (keep / "manifest.json").exists()
    with pytest.raises(ConfigError, match="not a directory"):
        with output_dir(keep / "notes.txt"):
            pass
    with output_dir(tmp_path / "ok") as p:  # success: nothing tidied
        p.mkdir(exist_ok=True)
        (p / "manifest.json").write_text("{}")
    assert (tmp_path / "ok" / "manifest.json").exists()
