"""A model spec to a local directory: catalogue names, Hugging Face ids and plain paths.

Every LLM slot (reasoner, judge, NLI, checker, head, teacher, a training base) takes the same
specs, resolved here once:

- a catalogue name (``ragfast models list``, e.g. ``qwen2.5-coder-0.5b``): its converted cache
  directory (:func:`ragfast.models.catalogue.resolve`);
- an existing local path: itself;
- a Hugging Face id, ``owner/name`` (Search-R1's users pass ``PeterJinGo/SearchR1-...``): the
  snapshot in the Hugging Face cache, downloaded first as transformers would when the hub is
  reachable, and only looked up in the cache when ``HF_HUB_OFFLINE`` is set.

Anything else comes back unchanged, for the caller's own error.
"""
from __future__ import annotations

import re
from pathlib import Path

from ragfast.errors import ModelError

__all__ = ["is_hub_id", "hub_snapshot", "local_model"]

# owner/name as the hub spells them: letters, digits, '-', '_', '.'; no leading '.', no '..'.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")

#: What a causal LM needs from a repository (transformers reads no more): weights, configs,
#: tokenizer files and the chat template. Other files (GGUF copies, pytorch_model.bin when
#: safetensors exist, images) are not fetched.
_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "tokenizer*"]


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` reads as a Hugging Face ``owner/name`` id and is not an existing local path."""
    return (isinstance(spec, str) and bool(_HUB_ID.match(spec)) and ".." not in spec
            and not Path(spec).expanduser().exists())


def hub_snapshot(repo_id: str, what: str = "model") -> Path:
    """The local snapshot of ``repo_id``, as transformers finds it.

    Honours ``HF_HUB_OFFLINE`` (and ``HF_HOME`` / ``HF_HUB_CACHE``): offline, only the cache is
    read.

    Raises
    ------
    ModelError
        One line: offline and not cached (naming ``ragfast models list``), no such repository,
        or the hub not reachable.
    """
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError)
    except ImportError as exc:  # transformers always brings it; say so if it is gone
        raise ModelError(f"{what} {repo_id!r} is a Hugging Face id, which needs huggingface_hub") from exc
    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        d = snapshot_download(repo_id, allow_patterns=_PATTERNS, local_files_only=offline)
    except LocalEntryNotFoundError:
        if offline:
            raise ModelError(f"{what} {repo_id!r} is no local directory, and as a Hugging Face id it is not in the "
                             f"local Hugging Face cache ({constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE is set, so "
                             "nothing is downloaded: unset HF_HUB_OFFLINE, pass a local directory, or use a model "
                             "that ships offline (`ragfast models list`)") from None
        raise ModelError(f"{what} {repo_id!r}: the Hugging Face hub is not reachable and the id is not in the local "
                         "cache; pass a local directory or see `ragfast models list`") from None
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise ModelError(f"{what} {repo_id!r}: no such Hugging Face repository, or it needs a login "
                         f"({type(exc).__name__}); see `ragfast models list` for models that ship offline") from None
    except OSError as exc:  # connection errors are OSErrors (requests / httpx)
        raise ModelError(f"{what} {repo_id!r}: fetching it from the Hugging Face hub failed "
                         f"({' '.join(str(exc).split())[:160]})") from None
    p = Path(d)
    if not (p / "config.json").is_file():
        raise ModelError(f"{what} {repo_id!r}: the snapshot at {p} has no config.json (not a transformers model)")
    return p


def local_model(spec: str, what: str = "model", *, fetch: bool = False) -> str:
    """``spec`` as a local directory when it is a catalogue name or a Hugging Face id; else unchanged.

    Parameters
    ----------
    fetch : bool
        A catalogue model not yet in the cache is fetched and converted now
        (:func:`ragfast.models.catalogue.get`, one log line and a progress bar) instead of
        failing: the default bench's reasoner base is fetched on first use this way.

    Raises
    ------
    ModelError
        A catalogue model not yet fetched (naming ``ragfast models get NAME``), or a hub id that
        cannot be had (see :func:`hub_snapshot`).
    """
    from ragfast.models.catalogue import get, is_catalogued, resolve

    if is_catalogued(spec):
        try:
            return str(resolve(spec))
        except ModelError:
            if not fetch:
                raise
            return str(get(spec))
    if is_hub_id(spec):
        return str(hub_snapshot(spec, what))
    return spec
