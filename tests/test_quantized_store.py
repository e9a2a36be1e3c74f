"""The saved quantised index format: mapped on load, searched in place, same answers as in memory."""
import json

import numpy as np
import pytest
import torch

from ragfast.errors import ConfigError, DataError
from ragfast.ops.topk_ip import quantize
from ragfast.retrieval.dense import DenseIndex
from ragfast.retrieval.quantized_store import QuantizedWriter, is_quantized_dir, open_quantized


def _unit(rng, n, d):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no RssAnon in /proc/self/status")


def _maps_file(t: torch.Tensor) -> bool:
    """True when the tensor's buffer lies in a file-backed mapping of this process."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            if lo <= addr < hi:
                return len(parts) >= 6 and parts[5].endswith(".npy")
    return False


@pytest.mark.parametrize("storage,rescore", [("int8", "fp16"), ("int8", None), ("bf16", None)])
def test_saved_codes_load_mapped_and_search_identically(tmp_path, storage, rescore):
    rng = np.random.default_rng(26)
    x = _unit(rng, 3001, 67)  # odd sizes: the kernels' tails
    q = rng.standard_normal((13, 67)).astype(np.float32)
    mem = DenseIndex("flat", stored=quantize(x, storage, rescore=rescore))
    path = mem.save(tmp_path / "idx")  # no fp32 vectors behind it: the codes themselves are written
    assert is_quantized_dir(path) and not (path / "vectors.npy").exists()
    loaded = DenseIndex.load(path)
    st = loaded.stored
    assert loaded.vectors is None and loaded.storage == storage and len(loaded) == 3001
    # the tensors are the read-only file maps, not private copies
    assert _maps_file(st.data)
    if storage == "int8":
        assert _maps_file(st.scale) and _maps_file(st.rowsum)
        assert (st.rescore is None) == (rescore is None)
        if rescore:
            assert _maps_file(st.rescore)
    # byte-identical storage
    ref = mem.stored
    assert torch.equal(st.data.view(torch.int8 if storage == "int8" else torch.int16),
                       ref.data.view(torch.int8 if storage == "int8" else torch.int16))
    from ragfast.ops.topk_ip import topk_ip_ref

    for k in (1, 10, 50):
        s1, i1 = mem.search(q, k)
        s2, i2 = loaded.search(q, k)
        assert torch.equal(i1, i2) and torch.equal(s1, s2)
        r1, j1 = topk_ip_ref(q, ref, k)
        r2, j2 = topk_ip_ref(q, st, k)
        assert torch.equal(j1, j2) and torch.equal(r1, r2)


def test_quantized_writer_chunks_equal_one_quantize(tmp_path):
    rng = np.random.default_rng(7)
    x = _unit(rng, 1000, 48)
    w = QuantizedWriter(tmp_path / "w", 1000, 48, storage="int8", rescore="fp16", extra_meta={"note": "test"})
    for s, e in ((0, 400), (700, 1000), (400, 700)):  # out of order on purpose
        w.write(s, x[s:e])
        w.flush()
    assert not is_quantized_dir(tmp_path / "w")  # unfinished: no meta.json, never loads
    w.finish()
    st, meta = open_quantized(tmp_path / "w")
    assert meta["note"] == "test" and meta["rescore"] == "fp16" and meta["oversample"] == 4
    whole = quantize(x, "int8", rescore="fp16")
    assert torch.equal(st.data, whole.data) and torch.equal(st.scale, whole.scale)
    assert torch.equal(st.rowsum, whole.rowsum) and torch.equal(st.rescore, whole.rescore)
    # numpy oracle of the stored codes: symmetric per-row scale max|x| / 127
    scale = np.abs(x).max(axis=1) / 127
    np.testing.assert_array_equal(st.data.numpy(), np.clip(np.round(x / scale[:, None]), -127, 127))
    # resuming reopens the same files in place
    w2 = QuantizedWriter(tmp_path / "w", 1000, 48, storage="int8", rescore="fp16", resume=True)
    w2.write(0, x[:10])
    w2.finish()
    assert torch.equal(open_quantized(tmp_path / "w")[0].data, whole.data)


def test_mapped_search_does_not_copy_the_codes(tmp_path):
    rng = np.random.default_rng(3)
    n, d = 120_000, 256  # 30.7 MB of codes, 61 MB of fp16 re-score copy
    w = QuantizedWriter(tmp_path / "big", n, d, storage="int8", rescore="fp16")
    for s in range(0, n, 40_000):
        w.write(s, _unit(rng, 40_000, d))
    w.finish()
    idx = DenseIndex.load(tmp_path / "big", kernel_backend="cpp")
    q = rng.standard_normal((64, d)).astype(np.float32)
    idx.search(q, 10)  # warm: thread pools, page cache
    before = _rss_anon()
    for _ in range(3):
        idx.search(q, 10)
    grew = _rss_anon() - before
    # a private copy of the codes alone would add 30 MB; the kernels read the maps in place
    assert grew < 8 * 1024 * 1024, f"anonymous memory grew {grew / 1e6:.1f} MB during mapped searches"


def test_quantized_dir_errors(tmp_path):
    rng = np.random.default_rng(1)
    path = DenseIndex("flat", stored=quantize(_unit(rng, 50, 8), "int8")).save(tmp_path / "i")
    with pytest.raises(ConfigError, match="int8 codes"):
        DenseIndex.load(path, storage="bf16")
    np.save(path / "scale.npy", np.zeros(49, np.float32))
    with pytest.raises(DataError, match="scale.npy"):
        DenseIndex.load(path)
    with pytest.raises(ConfigError, match="codes=True"):
        DenseIndex("flat", vectors=_unit(rng, 50, 8)).save(tmp_path / "f", codes=True)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["layout"] == "quantized" and meta["ntotal"] == 50
