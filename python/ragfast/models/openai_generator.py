"""The reasoner backend for an OpenAI-compatible ``/v1/completions`` server (vLLM, SGLang).

One of the backends behind :class:`ragfast.models.base.Generator` (the in-process ones are in
:mod:`ragfast.models.generator`).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from ragfast.cost import CostLedger
from ragfast.errors import ConfigError, ModelError
from ragfast.http import check_url, get_json, post_json
from ragfast.models.base import Generator
from ragfast.models.generator import check_new_sessions, check_sessions, cut_at_stop
from ragfast.text import whitespace_tokens

__all__ = ["OpenAIGenerator"]


def _closing_tag_to_restore(text: str, stop: Sequence[str]) -> str | None:
    # Without the server saying which stop string matched, restore the one whose opening tag is
    # left open: "<search> q" -> "</search>". A plain end-of-sequence leaves every tag closed.
    best, best_pos = None, -1
    for s in stop:
        if s.startswith("</") and s.endswith(">"):
            opening = "<" + s[2:]
            i = text.rfind(opening)
            if i > text.rfind(s) and i > best_pos:
                best, best_pos = s, i
    return best


class OpenAIGenerator(Generator):
    """Client of an OpenAI-compatible ``/v1/completions`` server (vLLM, SGLang).

    Each session is its text (the server's prefix cache does the KV reuse); every turn sends one
    completion request per active session, ``concurrency`` at a time, greedy
    (``temperature=0``) with the stop strings. Servers leave the matched stop string out of the
    returned text, so it is put back: the one the server names in ``stop_reason`` (vLLM), else
    the closing tag that is left open.

    Parameters
    ----------
    base_url : str
        E.g. ``http://127.0.0.1:8000`` or ``http://127.0.0.1:8000/v1``.
    model : str, optional
        The served model name. Without one, the server's ``/v1/models`` is asked and its single
        model is used (several models: an error that lists them).
    api_key : str, optional
        Sent as a bearer token.
    concurrency : int
        Requests in flight at once.
    tokenizer : str or Path, optional
        Local tokenizer directory of the served model: enables the chat template and observation
        truncation in the model's own tokens (without it prompts go raw and observations are
        cut by whitespace tokens).
    model_config : str, Path or dict, optional
        The served model's config (a ``config.json``, a model directory or a dict), to record
        analytic FLOPs in the ledger from each call's token counts and past length.

    Notes
    -----
    Token counts come from the server's ``usage`` (prompt, completion, and
    ``prompt_tokens_details.cached_tokens`` where the server reports prefix-cache hits, as
    vLLM does). A server that sends no ``usage`` is counted with the local tokenizer, else by
    whitespace; ``describe()["token_source"]`` says which sources were used. Every request's
    latency is kept in ``call_seconds``.
    timeout : float
        Seconds per request.
    retries : int
        Extra attempts on connection errors and 5xx answers.
    meaningful : bool
        Whether the served model's answers mean anything (False for a random-weight model).
    """

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, concurrency: int = 16, *,
                 tokenizer: Any = None, model_config: Any = None, timeout: float = 600.0, retries: int = 2,
                 meaningful: bool = True, seed: int | None = None):
        import httpx

        check_url(base_url, "base_url")
        if concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1, got {concurrency}")
        url = base_url.rstrip("/")
        self.base_url = url if url.endswith("/v1") else url + "/v1"
        self.concurrency = int(concurrency)
        self.retries = int(retries)
        self.seed = seed
        self.meaningful = bool(meaningful)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=timeout, headers=headers,
                                    limits=httpx.Limits(max_connections=self.concurrency))
        self.model = model or self._served_model()
        self.name = f"{self.model} @ {self.base_url}"
        self.call_seconds: list[float] = []
        self.token_sources: dict[str, int] = {}
        self.tokenizer = None
        if tokenizer is not None:
            from transformers import AutoTokenizer

            try:
                self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
            except (OSError, ValueError) as exc:
                raise ModelError(f"cannot load a tokenizer from {tokenizer}: {exc}") from None
        if isinstance(model_config, (str, Path)):
            from ragfast.flops import read_config

            model_config = read_config(model_config)
        self.model_config = model_config
        self._sessions: dict[str, str] = {}

    def _served_model(self) -> str:
        url = self.base_url + "/models"
        try:
            body = get_json(self._client, url, retries=0, error=ModelError)
        except ModelError as exc:
            raise ModelError(f"{exc} (to find the served model; or name it with --served-model)") from None
        try:
            names = [m["id"] for m in body["data"]]
        except (KeyError, TypeError):
            raise ModelError(f"{url} answered without a model list; name the model with --served-model") from None
        if len(names) != 1:
            raise ConfigError(f"{url} serves {len(names)} models ({', '.join(names) or 'none'}); "
                              "choose one with --served-model")
        return str(names[0])

    def describe(self) -> dict[str, Any]:
        lat = sorted(self.call_seconds)
        d: dict[str, Any] = {
            "name": self.name, "meaningful": self.meaningful, "class": type(self).__name__,
            "chat_template": bool(self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None)),
            "token_source": dict(self.token_sources) or
            ("usage, else tokenizer" if self.tokenizer is not None else "usage, else whitespace"),
            "flops": "analytic from the model config" if self.model_config is not None else
            "unknown (give the served model's config for analytic FLOPs)",
        }
        if lat:
            d["calls"] = len(lat)
            d["call_seconds_p50"] = lat[len(lat) // 2]
            d["call_seconds_p99"] = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        return d

    def _count(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return whitespace_tokens(text)

    def close(self) -> None:
        self._client.close()

    def format_prompt(self, user_text: str) -> str:
        """The chat template of the local tokenizer when given, else the raw text."""
        if self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": user_text}],
                                                      add_generation_prompt=True, tokenize=False)
        return user_text

    def truncate_tokens(self, texts: Sequence[str], max_tokens: int) -> list[str]:
        """Observation cap in the model's tokens with a tokenizer, else in whitespace tokens."""
        if self.tokenizer is None:
            from ragfast.text import truncate_whitespace_tokens

            return [truncate_whitespace_tokens(t, max_tokens) for t in texts]
        out = []
        for t in texts:
            ids = self.tokenizer(t, add_special_tokens=False)["input_ids"]
            out.append(t if len(ids) <= max_tokens else
                       self.tokenizer.decode(ids[:max_tokens], skip_special_tokens=False,
                                             clean_up_tokenization_spaces=False))
        return out

    def start(self, ids: Sequence[str], prompts: Sequence[str]) -> None:
        check_new_sessions(self._sessions, ids, prompts, "OpenAIGenerator.start")
        for i, p in zip(ids, prompts):
            self._sessions[i] = p

    def append(self, ids: Sequence[str], texts: Sequence[str]) -> None:
        check_sessions(self._sessions, ids, "OpenAIGenerator.append")
        for i, t in zip(ids, texts):
            self._sessions[i] += t

    def end(self, ids: Sequence[str]) -> None:
        for i in ids:
            self._sessions.pop(i, None)

    def _post(self, prompt: str, stop: list[str], max_new: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_new, "temperature": 0.0,
                                "stop": stop, "n": 1}
        if self.seed is not None:
            body["seed"] = self.seed
        url = self.base_url + "/completions"
        t0 = time.perf_counter()
        data = post_json(self._client, url, body, retries=self.retries, error=ModelError)
        self.call_seconds.append(time.perf_counter() - t0)
        try:
            _ = data["choices"][0]["text"]
        except (KeyError, IndexError, TypeError):
            raise ModelError(f"{url}: not an OpenAI completions answer: {str(data)[:300]}") from None
        return data

    def generate(self, ids: Sequence[str], *, stop: Sequence[str], max_new_tokens: int,
                 ledger: CostLedger | None = None) -> list[str]:
        from concurrent.futures import ThreadPoolExecutor

        check_sessions(self._sessions, ids, "OpenAIGenerator.generate")
        stop = list(stop)
        t0 = time.perf_counter()
        prompts = [self._sessions[i] for i in ids]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, max(1, len(ids)))) as pool:
            answers = list(pool.map(lambda p: self._post(p, stop, max_new_tokens), prompts))
        texts, fresh, cached, produced, flops = [], [], [], [], []
        for i, p, data in zip(ids, prompts, answers):
            choice = data["choices"][0]
            text = choice["text"]
            if choice.get("finish_reason") == "stop":
                matched = choice.get("stop_reason")
                if not (isinstance(matched, str) and matched in stop):
                    matched = _closing_tag_to_restore(text, stop)
                if matched and not text.endswith(matched):
                    text += matched
            text, _ = cut_at_stop(text, stop)
            self._sessions[i] += text
            texts.append(text)
            usage = data.get("usage") or {}
            n_prompt = int(usage.get("prompt_tokens") or 0)
            n_cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
            n_out = int(usage.get("completion_tokens") or 0)
            source = "usage"
            if not usage:
                # no usage: count locally; the server's own tokens are what it computed
                source = "tokenizer" if self.tokenizer is not None else "whitespace"
                n_prompt, n_out = self._count(p), self._count(text)
            self.token_sources[source] = self.token_sources.get(source, 0) + 1
            fresh.append(max(0, n_prompt - n_cached))
            cached.append(n_cached)
            produced.append(n_out)
            if self.model_config is not None:
                from ragfast.flops import completion_flops

                flops.append(completion_flops(self.model_config, n_prompt, min(n_cached, n_prompt), n_out))
        if ledger is not None:
            ledger.add_batch("reasoner", list(ids), seconds=time.perf_counter() - t0, input_tokens=fresh,
                             cached_tokens=cached, output_tokens=produced, flops=flops or None)
        return texts
