"""Cost at a declared scale: price recorded work on a declared model and device (a roofline).

A bench on a laptop records real token counts and FLOPs, but for small or stand-in models. This
module answers "what would this run cost with a 7B reasoner on an H200?": it takes each
question's recorded tokens (and, for components without a declared model, their recorded FLOPs
and bytes scanned) and prices them as ``max(FLOPs / peak, bytes moved / bandwidth)`` on a
device from a small table of nominal figures.

Every number here is *projected*: nominal peaks are upper bounds that real kernels reach a
fraction of, so a projection is a lower bound on time, useful for comparing components with
one another (does the judge cost more than the reasoner turns it saves?), not for predicting
wall time. Reports print it next to what was measured, labelled as such.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from ragfast.errors import ConfigError
from ragfast.accounting.flops import completion_flops, forward_flops, read_config

__all__ = ["DeviceProfile", "DEVICES", "MODEL_PRESETS", "device_profile", "model_config", "decoder_params",
           "ComponentProjection", "project_run", "project_questions"]


@dataclass(frozen=True)
class DeviceProfile:
    """Nominal peak dense BF16 (GPU) or FP32 (CPU) FLOP/s and memory bandwidth of one device."""

    name: str
    flops_per_s: float
    bytes_per_s: float
    source: str


# Nominal figures from the vendors' datasheets (dense, no sparsity).
DEVICES: dict[str, DeviceProfile] = {
    "h200": DeviceProfile("NVIDIA H200 SXM", 989e12, 4.8e12,
                          "NVIDIA H200 datasheet: 989 TFLOP/s dense BF16 Tensor Core, 4.8 TB/s HBM3e"),
    "h100": DeviceProfile("NVIDIA H100 SXM", 989e12, 3.35e12,
                          "NVIDIA H100 datasheet: 989 TFLOP/s dense BF16 Tensor Core, 3.35 TB/s HBM3"),
    "a100": DeviceProfile("NVIDIA A100 SXM 80GB", 312e12, 2.039e12,
                          "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16 Tensor Core, 2,039 GB/s HBM2e"),
    "l4": DeviceProfile("NVIDIA L4", 121e12, 300e9,
                        "NVIDIA L4 datasheet: 121 TFLOP/s dense BF16 Tensor Core, 300 GB/s GDDR6"),
}

# cpu-N: N cores, each 2 FMA pipes x 8 fp32 lanes x 2 FLOPs at 2.5 GHz (AVX2 or Zen 4's
# double-pumped AVX-512 alike), and 12.5 GB/s of DRAM bandwidth per core (this project's
# 2-core machine measured 24.9 GB/s, docs/capacity.md).
_CPU_FLOPS_PER_CORE = 2 * 8 * 2 * 2.5e9
_CPU_BYTES_PER_CORE = 12.5e9

# Configs of the models the S2G study runs, so a projection needs no download. The numbers
# are the released checkpoints' config.json values.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-7b": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
                   "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False},
    "qwen2.5-3b": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 2048,
                   "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
                   "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
}


def device_profile(name: str) -> DeviceProfile:
    """A device from :data:`DEVICES`, or ``cpu-N`` for N cores.

    Raises
    ------
    ConfigError
        For an unknown name.
    """
    key = name.strip().lower()
    if key in DEVICES:
        return DEVICES[key]
    if key.startswith("cpu-") and key[4:].isdigit() and int(key[4:]) > 0:
        n = int(key[4:])
        return DeviceProfile(f"{n}-core CPU", n * _CPU_FLOPS_PER_CORE, n * _CPU_BYTES_PER_CORE,
                             "nominal: 32 fp32 FLOP/cycle at 2.5 GHz and 12.5 GB/s per core")
    raise ConfigError(f"unknown device profile {name!r}; expected one of {', '.join(DEVICES)} or cpu-N")


def model_config(spec: str | Mapping[str, Any]) -> dict[str, Any]:
    """A decoder config from a preset name (:data:`MODEL_PRESETS`), a config.json or a model directory."""
    if isinstance(spec, Mapping):
        return dict(spec)
    if spec.lower() in MODEL_PRESETS:
        return dict(MODEL_PRESETS[spec.lower()])
    try:
        return read_config(spec)
    except Exception as exc:
        raise ConfigError(f"{spec!r} is neither a model preset ({', '.join(MODEL_PRESETS)}) nor a model config: "
                          f"{exc}") from None


def decoder_params(cfg: Mapping[str, Any]) -> int:
    """Weights of a llama-style decoder (embeddings, attention, gated MLP, untied head)."""
    hid, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim", hid // heads)
    layer = hid * heads * hd * 2 + 2 * hid * kv * hd + 3 * hid * cfg["intermediate_size"]
    emb = cfg["vocab_size"] * hid
    return int(cfg["num_hidden_layers"] * layer + emb * (1 if cfg.get("tie_word_embeddings") else 2))


def _kv_bytes_per_token(cfg: Mapping[str, Any], dtype_bytes: int) -> int:
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim", cfg["hidden_size"] // heads)
    return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * hd * dtype_bytes


@dataclass
class ComponentProjection:
    """One component's recorded and projected cost over a run (sums over its questions)."""

    component: str
    model: str  # the declared model, or "as recorded"
    calls: float
    tokens: float
    measured_flops: float
    measured_seconds: float
    projected_flops: float
    projected_bytes: float
    projected_seconds: float
    bound: str  # "compute" or "memory" (decoders: per phase, prefill and decode)
    notes: list[str] = field(default_factory=list)


def _decoder_projection(comp: str, trajs: Sequence[Mapping[str, Any]], cfg: Mapping[str, Any], name: str,
                        dev: DeviceProfile, batch: int, dtype_bytes: int, judge: bool) -> ComponentProjection:
    """Prefill and decode priced apart: each is its own roofline, and their times add up.

    Prefill reads the weights once per batched pass and is compute-bound at any real length;
    decode reads the weights once per step for the whole batch, plus each sequence's KV cache,
    and is memory-bound unless the batch is large.
    """
    weights = decoder_params(cfg) * dtype_bytes
    kv_tok = _kv_bytes_per_token(cfg, dtype_bytes)
    calls = tokens = m_fl = m_s = 0.0
    pre_fl = pre_by = dec_fl = dec_by = 0.0
    for t in trajs:
        r = (t.get("cost") or {}).get(comp) or {}
        c = float(r.get("calls", 0) or 0)
        if c <= 0:
            continue
        fresh, cached, out = (float(r.get(k, 0) or 0) for k in ("input_tokens", "cached_tokens", "output_tokens"))
        calls += c
        tokens += fresh + cached + out
        m_fl += float(r.get("flops", 0) or 0)
        m_s += float(r.get("seconds", 0) or 0)
        # Per-call averages: the trajectory keeps sums, not each call's lengths.
        p = max(1, round((fresh + cached) / c))
        k = min(round(cached / c), p - 1)
        o = 0 if judge else max(1, round(out / c))
        # a judge scores a state in one prefill pass (next-token logits of the last position)
        pf = forward_flops(cfg, [p - k], [k], logits="last")
        pre_fl += c * pf
        pre_by += c * (weights / batch + kv_tok * k)
        if o > 1:
            dec_fl += c * (completion_flops(cfg, p, k, o) - pf)
            dec_by += c * (o - 1) * (weights / batch + kv_tok * (p + o / 2))
    t_pre = max(pre_fl / dev.flops_per_s, pre_by / dev.bytes_per_s)
    t_dec = max(dec_fl / dev.flops_per_s, dec_by / dev.bytes_per_s)

    def bound(fl: float, by: float) -> str:
        return "compute" if fl / dev.flops_per_s >= by / dev.bytes_per_s else "memory"

    kind = bound(pre_fl, pre_by) if judge else f"prefill {bound(pre_fl, pre_by)}, decode {bound(dec_fl, dec_by)}"
    return ComponentProjection(comp, name, calls, tokens, m_fl, m_s, pre_fl + dec_fl, pre_by + dec_by,
                               t_pre + t_dec, kind, [f"{dtype_bytes}-byte weights, {batch} sequences per batch"])


def _recorded_projection(comp: str, trajs: Sequence[Mapping[str, Any]], dev: DeviceProfile) -> ComponentProjection:
    calls = tokens = fl = s = by = 0.0
    for t in trajs:
        r = (t.get("cost") or {}).get(comp) or {}
        calls += float(r.get("calls", 0) or 0)
        tokens += sum(float(r.get(k, 0) or 0) for k in ("input_tokens", "cached_tokens", "output_tokens"))
        fl += float(r.get("flops", 0) or 0)
        s += float(r.get("seconds", 0) or 0)
        by += float(r.get("bytes_scanned", 0) or 0)
    t_fl, t_by = fl / dev.flops_per_s, by / dev.bytes_per_s
    notes = ["recorded FLOPs and bytes scanned; model weights assumed resident"]
    if calls and not fl and not by:
        notes.append("no FLOPs or bytes recorded: projected as free")
    return ComponentProjection(comp, "as recorded", calls, tokens, fl, s, fl, by, max(t_fl, t_by),
                               "compute" if t_fl >= t_by else "memory", notes)


def project_run(trajectories: Mapping[str, Sequence[Mapping[str, Any]]], device: str, *,
                reasoner: str | Mapping[str, Any] | None = None, judge: str | Mapping[str, Any] | None = None,
                batch: int = 64, dtype_bytes: int = 2) -> dict[str, Any]:
    """Project every method's recorded cost onto a declared reasoner (and judge) and device.

    Parameters
    ----------
    trajectories : mapping
        Method name -> its trajectory records (each with a ``cost`` mapping per component).
    device : str
        A :func:`device_profile` name (``h200``, ``a100``, ``cpu-16``, ...).
    reasoner, judge : str or mapping, optional
        Declared decoder for that slot: a :data:`MODEL_PRESETS` name, a config.json path, a
        model directory or a config dict. Its FLOPs are recomputed from the recorded token
        counts. A slot without one is priced from its recorded FLOPs.
    batch : int
        Sequences decoded together (weights are read once per step for all of them).
    dtype_bytes : int
        Bytes per weight and KV element (2 for bf16).

    Returns
    -------
    dict
        ``device`` (the profile), ``methods``: method -> {"components": [ComponentProjection
        as dict], "questions", "projected_seconds_per_question", "measured_seconds_per_question"}.
    """
    if batch < 1 or dtype_bytes < 1:
        raise ConfigError(f"batch and dtype_bytes must be >= 1, got {batch} and {dtype_bytes}")
    dev = device_profile(device)
    declared = {c: (model_config(s), s if isinstance(s, str) else "declared config")
                for c, s in (("reasoner", reasoner), ("judge", judge)) if s is not None}
    out: dict[str, Any] = {"device": asdict(dev), "label": "projected (nominal roofline), not measured",
                           "declared": {c: n for c, (_, n) in declared.items()}, "methods": {}}
    for method, trajs in trajectories.items():
        comps = sorted({c for t in trajs for c in (t.get("cost") or {})})
        rows = []
        for c in comps:
            if c in declared:
                cfg, name = declared[c]
                rows.append(_decoder_projection(c, trajs, cfg, name, dev, batch, dtype_bytes, judge=(c == "judge")))
            else:
                rows.append(_recorded_projection(c, trajs, dev))
        n = max(1, len(trajs))
        out["methods"][method] = {
            "questions": len(trajs),
            "components": [asdict(r) for r in rows],
            "projected_seconds_per_question": sum(r.projected_seconds for r in rows) / n,
            "measured_seconds_per_question": sum(r.measured_seconds for r in rows) / n,
        }
    return out


def project_questions(trajectories: Sequence[Mapping[str, Any]], device: str, models: Mapping[str, Any], *,
                      one_pass: Sequence[str] = ("judge",), batch: int = 64,
                      dtype_bytes: int = 2) -> dict[str, dict[str, dict[str, float]]]:
    """Each question's projected cost, component by component (what a bootstrap over questions needs).

    Parameters
    ----------
    trajectories : sequence of trajectory records
        Each with ``id`` and a ``cost`` mapping per component.
    device : str
        A :func:`device_profile` name.
    models : mapping
        Component -> declared decoder (as ``reasoner`` in :func:`project_run`); other components
        are priced from their recorded FLOPs and bytes.
    one_pass : sequence of str
        Declared components whose calls score in one prefill pass (a STOP judge); the others
        generate (prefill, then decode).
    batch, dtype_bytes
        As in :func:`project_run`.

    Returns
    -------
    dict
        Question id -> component -> ``{"flops", "bytes", "seconds"}``. A question's FLOPs and
        bytes sum to :func:`project_run`'s over the run; its seconds are its own roofline.
    """
    if batch < 1 or dtype_bytes < 1:
        raise ConfigError(f"batch and dtype_bytes must be >= 1, got {batch} and {dtype_bytes}")
    dev = device_profile(device)
    declared = {c: (model_config(s), s if isinstance(s, str) else "declared config") for c, s in models.items()}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for t in trajectories:
        row = {}
        for c in (t.get("cost") or {}):
            if c in declared:
                cfg, name = declared[c]
                p = _decoder_projection(c, [t], cfg, name, dev, batch, dtype_bytes, judge=c in one_pass)
            else:
                p = _recorded_projection(c, [t], dev)
            row[c] = {"flops": p.projected_flops, "bytes": p.projected_bytes, "seconds": p.projected_seconds}
        out[str(t["id"])] = row
    return out


def render_markdown(proj: Mapping[str, Any]) -> str:
    """The projection as a markdown section, measured and projected columns side by side."""
    d = proj["device"]
    lines = [f"## Cost at a declared scale ({proj['label']})", "",
             f"Device: {d['name']} ({d['flops_per_s'] / 1e12:.3g} TFLOP/s, {d['bytes_per_s'] / 1e9:.4g} GB/s; "
             f"{d['source']}). Declared models: "
             + (", ".join(f"{c} = {n}" for c, n in proj["declared"].items()) or "none (recorded FLOPs only)") + ".",
             "", "| method | component | model | calls | measured GFLOPs | measured s | projected GFLOPs "
             "| projected ms | bound |", "|---|---|---|---|---|---|---|---|---|"]
    for m, r in proj["methods"].items():
        for c in r["components"]:
            lines.append(f"| {m} | {c['component']} | {c['model']} | {c['calls']:.0f} | "
                         f"{c['measured_flops'] / 1e9:.3g} | {c['measured_seconds']:.3g} | "
                         f"{c['projected_flops'] / 1e9:.4g} | {c['projected_seconds'] * 1e3:.3g} | {c['bound']} |")
    lines.append("")
    for m, r in proj["methods"].items():
        lines.append(f"- {m}: projected {r['projected_seconds_per_question'] * 1e3:.3g} ms/question on "
                     f"{d['name']} (measured here: {r['measured_seconds_per_question'] * 1e3:.3g} ms/question).")
    return "\n".join(lines) + "\n"
