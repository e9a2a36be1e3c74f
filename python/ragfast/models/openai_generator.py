"""The reasoner backend for an OpenAI-compatible ``/v1/completions`` server (vLLM, SGLang, llama.cpp).

One of the backends behind :class:`ragfast.models.base.Generator` (the in-process ones are in
:mod:`ragfast.models.generator`).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit, urlunsplit

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError, ModelError, blame
from ragfast.infra.http import check_url, get_json, post_json
from ragfast.models.base import Generator
from ragfast.models.base import check_new_sessions, check_sessions, cut_at_stop
from ragfast.text import whitespace_tokens

__all__ = ["OpenAIGenerator", "canonical_url"]

log = logging.getLogger(__name__)

#: Host names that all mean this machine's loopback interface.
_LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]", "0.0.0.0"}


def canonical_url(url: str) -> str:
    """``url`` with a loopback host spelled ``127.0.0.1`` and no trailing slash.

    ``http://localhost:8000`` and ``http://127.0.0.1:8000/`` are the same server, so a run
    started with one may be resumed with the other.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    if host.lower() in _LOOPBACK or f"[{host}]" in _LOOPBACK:
        netloc = "127.0.0.1" + (f":{parts.port}" if parts.port else "")
        if parts.username:
            netloc = parts.username + (f":{parts.password}" if parts.password else "") + "@" + netloc
        parts = parts._replace(netloc=netloc)
    return urlunsplit(parts).rstrip("/")


def _server_stop(choice: dict[str, Any], data: dict[str, Any]) -> tuple[bool, Any]:
    """Whether the server said what ended a ``finish_reason: "stop"`` completion, and what.

    The matched stop string, or an end-of-sequence token id / None (nothing to restore). Read
    from ``stop_reason`` (vLLM), ``matched_stop`` (SGLang), or llama.cpp's ``__verbose``
    (``stop_type`` "word" with its ``stopping_word``, "eos"; sent when the request asks
    ``"verbose": true``), whose OpenAI fields say ``"stop"`` for both.
    """
    for key in ("stop_reason", "matched_stop"):
        if key in choice:
            return True, choice[key]
    verbose = data.get("__verbose")
    if isinstance(verbose, dict) and verbose.get("stop_type") in ("word", "eos"):
        return True, verbose.get("stopping_word") if verbose["stop_type"] == "word" else None
    return False, None


def _cached_tokens(usage: dict[str, Any], data: dict[str, Any]) -> int | None:
    """Prompt tokens served from the prefix cache, None where the answer does not say.

    ``usage.prompt_tokens_details.cached_tokens`` (vLLM with ``--enable-prompt-tokens-details``,
    llama.cpp), else llama.cpp's own ``timings.cache_n`` (its versions before the usage field).
    """
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and "cached_tokens" in details:
        return int(details["cached_tokens"] or 0)
    timings = data.get("timings")
    if isinstance(timings, dict) and "cache_n" in timings:
        return int(timings["cache_n"] or 0)
    return None


def _closing_tag_to_restore(text: str, stop: Sequence[str]) -> str | None:
    # Only for a server that does not say why it stopped (no stop_reason / matched_stop field):
    # restore the closing tag whose opening tag is left open, "<search> q" -> "</search>". Such
    # a server cannot tell this from "<search> q" + end-of-sequence, which describe() owns up to.
    best, best_pos = None, -1
    for s in stop:
        if s.startswith("</") and s.endswith(">"):
            opening = "<" + s[2:]
            i = text.rfind(opening)
            if i > text.rfind(s) and i > best_pos:
                best, best_pos = s, i
    return best


class OpenAIGenerator(Generator):
    """Client of an OpenAI-compatible ``/v1/completions`` server (vLLM, SGLang, llama.cpp).

    Each session is its text (the server's prefix cache does the KV reuse); every turn sends one
    completion request per active session, ``concurrency`` at a time, greedy
    (``temperature=0``) with the stop strings. With ``generate(..., partial=True)`` (the Search-R1
    loop's ``refill``) a call returns the completions that have come back and leaves the other
    requests in flight, so a finished turn searches and sends its next request while a long
    turn is still being generated: the server batches whatever is in flight, and the client no
    longer waits each turn for its slowest row. Servers leave the matched stop string out of the
    returned text, so it is put back: the one the server names in ``stop_reason`` (vLLM),
    ``matched_stop`` (SGLang) or ``__verbose.stopping_word`` (llama.cpp, whose model list says
    ``owned_by: llamacpp``; only its requests ask ``"verbose": true``). When the server names an
    end-of-sequence token (an int, or llama.cpp's ``stop_type: "eos"``) or nothing (``null``),
    nothing is put back: ``"<answer> London"`` then end-of-sequence stays an unclosed tag, an
    invalid action, as on the local backend. Only a server that says none of these gets the
    closing tag left open restored (a guess, logged once and counted in
    ``describe()["stop_source"]``).

    Parameters
    ----------
    base_url : str
        E.g. ``http://127.0.0.1:8000`` or ``http://127.0.0.1:8000/v1``.
    model : str, optional
        The served model name. Without one, the server's ``/v1/models`` is asked and its single
        model is used (several models: an error that lists them). The list also says which
        server it is (``owned_by``) and its context length (vLLM's ``max_model_len``,
        llama.cpp's per-slot ``meta.n_ctx``).
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
    max_context : int, optional
        The prompt budget in tokens (``--prompt-budget``): a longer session is sent as its last
        ``max_context`` tokens, as the local backend keeps them (token ids with a tokenizer,
        else whitespace tokens). Where the server lists its context length (vLLM, llama.cpp),
        the prompt is also cut to leave ``max_new_tokens`` of room, so the server never refuses it.

    Notes
    -----
    Token counts come from the server's ``usage`` (prompt, completion, and
    ``prompt_tokens_details.cached_tokens`` where the server reports prefix-cache hits, as
    vLLM does with ``--enable-prompt-tokens-details`` and llama.cpp always; llama.cpp's
    ``timings.cache_n`` where only that is sent). A server that sends no ``usage`` is
    counted with the local tokenizer, else by whitespace; ``describe()["token_source"]`` says
    which sources were used. A server that sends ``usage`` without cached tokens has every
    prompt token booked as computed: a warning is logged once and ``describe()["cached_tokens"]``
    says so. Every request's latency is kept in ``call_seconds``, and where the server times its
    own work (llama.cpp's ``timings``) the sums of its prompt and generation milliseconds and
    tokens in ``server_timings``. A ``ragfast_tiny.json`` in
    the tokenizer or config directory (a tiny test model) marks the answers meaningless, as the
    local backend does.
    timeout : float
        Seconds per request.
    retries : int
        Extra attempts on connection errors and 5xx answers.
    meaningful : bool, optional
        Whether the served model's answers mean anything. Default: False when the tokenizer or
        config directory holds a ``ragfast_tiny.json`` (a tiny test model), else True.
    seed : int, optional
        Sent with each request.
    """

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, concurrency: int = 16, *,
                 tokenizer: Any = None, model_config: Any = None, timeout: float = 600.0, retries: int = 2,
                 meaningful: bool | None = None, seed: int | None = None, max_context: int | None = None):
        import httpx

        check_url(base_url, "base_url")
        if concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1, got {concurrency}")
        if max_context is not None and max_context < 2:
            raise ConfigError(f"max_context must be >= 2 tokens, got {max_context}")
        url = canonical_url(base_url)
        self.base_url = url if url.endswith("/v1") else url + "/v1"
        self.concurrency = int(concurrency)
        self.retries = int(retries)
        self.seed = seed
        self.max_context = max_context
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=timeout, headers=headers,
                                    limits=httpx.Limits(max_connections=self.concurrency))
        #: the server's context length, where its model list gives one (vLLM: ``max_model_len``,
        #: llama.cpp: the slot's ``meta.n_ctx``)
        self.server_max_len: int | None = None
        #: who serves, as the model list says (``owned_by``: "vllm", "llamacpp"), where it says
        self.served_by: str | None = None
        self.model = self._served_model(model)
        self.name = f"{self.model} @ {self.base_url}"
        self.call_seconds: list[float] = []
        self.token_sources: dict[str, int] = {}
        self.stop_sources: dict[str, int] = {}  # "server" (stop_reason / matched_stop) or "guessed"
        self.cached_unreported = 0  # calls whose answer had no cached-token count
        self.server_timings: dict[str, float] = {}  # sums of llama.cpp's per-call timings
        self.truncations = 0  # prompts cut to the budget
        self.note = ""
        marker = None
        for src in (tokenizer, model_config):
            if isinstance(src, (str, Path)) and marker is None:
                from ragfast.models.tiny import tiny_marker

                marker = tiny_marker(src)
        if meaningful is None:
            meaningful = True
            if marker is not None:
                # the same rule as the local backend: a tiny model's answers mean nothing
                meaningful = bool(marker.get("meaningful", not marker.get("random_weights", False)))
                self.note = str(marker.get("note") or "random-weight tiny model: answers are meaningless")
        self.meaningful = bool(meaningful)
        self.tokenizer = None
        if tokenizer is not None:
            from transformers import AutoTokenizer

            try:
                self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
            except (OSError, ValueError) as exc:
                raise ModelError(f"cannot load a tokenizer from {tokenizer}: {exc}") from None
        if isinstance(model_config, (str, Path)):
            from ragfast.accounting.flops import read_config

            model_config = read_config(model_config)
        self.model_config = model_config
        self._sessions: dict[str, str] = {}
        #: session -> (future of its completion, what was sent, its stop strings): requests a
        #: partial call left in flight
        self._flight: dict[str, tuple[Any, tuple[str | list[int], int | None], list[str]]] = {}
        self._pool: Any = None  # the request threads, made at the first call

    def _served_model(self, model: str | None) -> str:
        """``model``, or the server's single model; reads the model's ``max_model_len`` too."""
        url = self.base_url + "/models"
        try:
            body = get_json(self._client, url, retries=0, error=ModelError)
            cards = [m for m in body["data"] if isinstance(m, dict) and "id" in m]
        except ModelError as exc:
            if model:  # a named model needs no list; its context length stays unknown
                return model
            raise ModelError(f"{exc} (to find the served model; or name it with --served-model)") from None
        except (KeyError, TypeError):
            if model:
                return model
            raise ModelError(f"{url} answered without a model list; name the model with --served-model") from None
        names = [str(m["id"]) for m in cards]
        if model is None and len(names) != 1:
            raise ConfigError(f"{url} serves {len(names)} models ({', '.join(names) or 'none'}); "
                              "choose one with --served-model")
        name = model or names[0]
        for m in cards:
            if str(m["id"]) != name:
                continue
            self.served_by = str(m["owned_by"]) if isinstance(m.get("owned_by"), str) else None
            meta = m.get("meta") if isinstance(m.get("meta"), dict) else {}
            n = m.get("max_model_len", meta.get("n_ctx"))  # vLLM, else llama.cpp's slot context
            if isinstance(n, int) and n > 1:
                self.server_max_len = n
        return name

    def describe(self) -> dict[str, Any]:
        """The slot entry; before any call it says so, after calls it counts what was used."""
        lat = sorted(self.call_seconds)
        fallback = "tokenizer" if self.tokenizer is not None else "whitespace"
        d: dict[str, Any] = {
            "name": self.name, "meaningful": self.meaningful, "class": type(self).__name__,
            "chat_template": bool(self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None)),
            "token_source": dict(self.token_sources) or f"no calls yet (usage, else {fallback})",
            "flops": "analytic from the model config" if self.model_config is not None else
            "unknown (give the served model's config for analytic FLOPs)",
            "calls": len(lat),
            "prompt_budget": self.max_context, "server_max_model_len": self.server_max_len,
            "prompt_truncations": self.truncations, "served_by": self.served_by,
        }
        if self.note:
            d["note"] = self.note
        if self.stop_sources:
            d["stop_source"] = dict(self.stop_sources)
        if self.server_timings:
            d["server_timings"] = dict(self.server_timings)
        if lat:
            d["cached_tokens"] = ("reported by the server" if not self.cached_unreported else
                                  f"NOT reported on {self.cached_unreported} of {len(lat)} calls: their prompt tokens "
                                  f"are booked as computed ({self._cache_hint()})")
            d["call_seconds_p50"] = lat[len(lat) // 2]
            d["call_seconds_p99"] = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        return d

    def _cache_hint(self) -> str:
        if self.served_by == "llamacpp":
            return "this llama.cpp server reports neither prompt_tokens_details nor timings.cache_n"
        return "start vLLM with --enable-prompt-tokens-details"

    def _count(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return whitespace_tokens(text)

    def close(self) -> None:
        self.end_flights()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
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
        busy = [i for i in ids if i in self._flight]
        if busy:
            raise RuntimeError(f"OpenAIGenerator.append: session {busy[0]!r} is in the middle of a turn "
                               "(generate(partial=True) has not returned its text yet)")
        for i, t in zip(ids, texts):
            self._sessions[i] += t

    def end(self, ids: Sequence[str]) -> None:
        self.end_flights(ids)
        for i in ids:
            self._sessions.pop(i, None)

    def _fit(self, prompt: str, max_new: int) -> tuple[str | list[int], int | None]:
        """The prompt to send, within the budget, and its token count where known here.

        Over the budget, the last ``cap`` tokens go as token ids (what the local backend keeps,
        with no re-tokenisation at the cut); without a tokenizer, the last ``cap`` whitespace
        tokens go as text.
        """
        cap = self.max_context
        if self.server_max_len is not None:
            room = self.server_max_len - max_new
            if room < 1:
                raise ConfigError(f"--max-new-tokens {max_new} leaves no room for a prompt in the server's "
                                  f"max_model_len {self.server_max_len}")
            cap = room if cap is None else min(cap, room)
        if cap is None:
            return prompt, None
        if self.tokenizer is None:
            words = prompt.split()
            if len(words) <= cap:
                return prompt, None
            self.truncations += 1
            return " ".join(words[-cap:]), None
        ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if len(ids) <= cap:
            return prompt, len(ids)
        self.truncations += 1
        return ids[-cap:], cap

    def _post(self, prompt: str | list[int], stop: list[str], max_new: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_new, "temperature": 0.0,
                                "stop": stop, "n": 1}
        if self.seed is not None:
            body["seed"] = self.seed
        if self.served_by == "llamacpp":
            body["verbose"] = True  # llama.cpp names the stop (word or end-of-sequence) only in __verbose
        url = self.base_url + "/completions"
        t0 = time.perf_counter()
        data = post_json(self._client, url, body, retries=self.retries, error=ModelError)
        self.call_seconds.append(time.perf_counter() - t0)
        try:
            _ = data["choices"][0]["text"]
        except (KeyError, IndexError, TypeError):
            raise ModelError(f"{url}: not an OpenAI completions answer: {str(data)[:300]}") from None
        return data

    #: ``generate(..., partial=True)`` is supported: requests stay in flight across calls (the
    #: Search-R1 loop's continuous batching; the server batches whatever is in flight).
    partial_turns = True

    def generate(self, ids: Sequence[str], *, stop: Sequence[str], max_new_tokens: int,
                 ledger: CostLedger | None = None, partial: bool = False) -> list[str | None]:
        """One completion request per session, ``concurrency`` in flight at a time.

        With ``partial`` the call returns once some of its sessions' completions have come back
        (None for the others, whose requests stay in flight for a later call naming them); the
        call's wall time is split over the completions it returns. On an error every request in
        flight is dropped and its session is as before the turn.
        """
        from concurrent.futures import FIRST_COMPLETED, ALL_COMPLETED, ThreadPoolExecutor, wait

        check_sessions(self._sessions, ids, "OpenAIGenerator.generate")
        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.concurrency)

        def post(session: str, p: tuple[str | list[int], int | None], stop: list[str], n: int) -> dict[str, Any]:
            with blame(None, [session]):  # the session whose request failed, not the whole batch
                return self._post(p[0], stop, n)

        stop = list(stop)
        for i in ids:
            if i not in self._flight:
                sent = self._fit(self._sessions[i], max_new_tokens)
                self._flight[i] = (self._pool.submit(post, i, sent, stop, max_new_tokens), sent, stop)
        try:
            done, _ = wait([self._flight[i][0] for i in ids],
                           return_when=FIRST_COMPLETED if partial else ALL_COMPLETED)
            back = [i for i in ids if self._flight[i][0] in done]
            answers = [self._flight[i][0].result() for i in back]
        except BaseException:
            self.end_flights()
            raise
        taken = [self._flight.pop(i) for i in back]
        texts, fresh, cached, produced, flops, uncached = [], [], [], [], [], []
        for i, (_, (p, n_local), stop), data in zip(back, taken, answers):
            choice = data["choices"][0]
            text = choice["text"]
            if choice.get("finish_reason") == "stop":
                text = self._restore_stop(choice, data, text, stop)
            text, _ = cut_at_stop(text, stop)
            self._sessions[i] += text
            texts.append(text)
            usage = data.get("usage") or {}
            n_prompt = int(usage.get("prompt_tokens") or 0)
            reported = _cached_tokens(usage, data)
            n_cached = reported or 0
            n_out = int(usage.get("completion_tokens") or 0)
            source = "usage"
            if not usage:
                # no usage: count locally; the server's own tokens are what it computed
                source = "tokenizer" if self.tokenizer is not None else "whitespace"
                n_prompt = n_local if n_local is not None else len(p) if isinstance(p, list) else self._count(p)
                n_out = self._count(text)
            elif reported is None:
                if not self.cached_unreported:
                    log.warning("%s sends no prompt_tokens_details.cached_tokens: every prompt token is booked as "
                                "computed (%s)", self.base_url, self._cache_hint())
                self.cached_unreported += 1
            self._add_timings(data.get("timings"))
            self.token_sources[source] = self.token_sources.get(source, 0) + 1
            n_cached = min(n_cached, n_prompt)
            fresh.append(n_prompt - n_cached)
            cached.append(n_cached)
            produced.append(n_out)
            if self.model_config is not None:
                from ragfast.accounting.flops import completion_flops

                flops.append(completion_flops(self.model_config, n_prompt, n_cached, n_out))
                # cache-independent: the same call with nothing served from the prefix cache
                uncached.append(completion_flops(self.model_config, n_prompt, 0, n_out))
        if ledger is not None:
            ledger.add_batch("reasoner", back, seconds=time.perf_counter() - t0, input_tokens=fresh,
                             cached_tokens=cached, output_tokens=produced, flops=flops or None,
                             flops_uncached=uncached or None)
        got = dict(zip(back, texts))
        return [got.get(i) for i in ids]

    def end_flights(self, ids: Sequence[str] | None = None) -> None:
        """Drop the requests in flight for ``ids`` (default: all): their answers are never read."""
        for i in list(self._flight) if ids is None else [i for i in ids if i in self._flight]:
            self._flight.pop(i)[0].cancel()  # a request already sent runs on; its answer is dropped

    def _add_timings(self, timings: Any) -> None:
        """Add llama.cpp's per-call ``timings`` (prompt and generation tokens and milliseconds)."""
        if not isinstance(timings, dict):
            return
        for key in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "cache_n"):
            v = timings.get(key)
            if isinstance(v, (int, float)):
                self.server_timings[key] = self.server_timings.get(key, 0) + v
        self.server_timings["calls"] = self.server_timings.get("calls", 0) + 1

    def _restore_stop(self, choice: dict[str, Any], data: dict[str, Any], text: str, stop: list[str]) -> str:
        """Put back the stop string the server matched (and left out of ``text``), if any."""
        said, matched = _server_stop(choice, data)
        if said:
            # The server says why it stopped: a stop string, or an end-of-sequence token id /
            # null (nothing to restore: an unclosed tag stays unclosed, an invalid action).
            self.stop_sources["server"] = self.stop_sources.get("server", 0) + 1
        else:
            matched = _closing_tag_to_restore(text, stop)
            if "guessed" not in self.stop_sources:
                log.warning("%s does not say which stop ended a completion (no stop_reason, matched_stop or "
                            "__verbose.stop_type): the closing tag left open is restored, a guess that turns an "
                            "unclosed tag then end-of-sequence into a closed one", self.base_url)
            self.stop_sources["guessed"] = self.stop_sources.get("guessed", 0) + 1
        if isinstance(matched, str) and matched in stop and not text.endswith(matched):
            text += matched
        return text
