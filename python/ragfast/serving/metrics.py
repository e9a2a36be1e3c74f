"""``/metrics``: a server's counters as Prometheus text."""
from __future__ import annotations

import math
from typing import Any

from ragfast.serving.memory import rss_bytes

__all__ = ["server_gauges", "prometheus_text"]


def server_gauges(st: dict[str, Any], item: str, key: str = "items") -> dict[str, float]:
    """A server's request, item, batch, error and queue counters for ``/metrics``.

    Parameters
    ----------
    st : dict
        The server's stats (``requests``, ``batches``, ``errors``, ``rejected``,
        ``isolation_retries``, ``queued_requests``, ``inflight_requests`` and the item counters).
    item : str
        What a request carries, as the metric names say it (``"states"``, ``"queries"``).
    key : str
        The item counters' name in ``st`` (``st[key]``, ``st["queued_" + key]``, ``st["inflight_" + key]``).
    """
    return {"requests_total": st["requests"], f"{item}_total": st[key], "batches_total": st["batches"],
            "errors_total": st["errors"], "rejected_total": st["rejected"],
            "isolation_retries_total": st["isolation_retries"], "queued_requests": st["queued_requests"],
            f"queued_{item}": st[f"queued_{key}"], "inflight_requests": st["inflight_requests"],
            f"inflight_{item}": st[f"inflight_{key}"], "resident_memory_bytes": rss_bytes()}


def prometheus_text(prefix: str, values: dict[str, float], help_: dict[str, str] | None = None) -> str:
    """Prometheus text exposition of flat gauges/counters (names get ``prefix_``)."""
    lines = []
    for k, v in values.items():
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            continue
        name = f"{prefix}_{k}"
        if help_ and k in help_:
            lines.append(f"# HELP {name} {help_[k]}")
        lines.append(f"# TYPE {name} {'counter' if k.endswith('_total') else 'gauge'}")
        lines.append(f"{name} {float(v):g}" if isinstance(v, float) else f"{name} {int(v)}")
    return "\n".join(lines) + "\n"
