"""``ragfast calibrate``: measure, on this machine, which ``topk_ip`` path the default takes."""
from __future__ import annotations

import json

import typer

from ragfast.errors import ConfigError

__all__ = ["register", "calibrate_cmd"]

# one line per paragraph: the help renderer keeps line breaks
_HELP = "\n\n".join((
    ('Measure which top-k path is faster on this machine and cache the choice.'),
    ('For every corpus storage (fp32, fp16, bf16, int8) and batch class (1, 4, 16, 64, 256 queries) it '
     'times the compiled kernels at the ISA level in use against torch mm + topk (for bf16 also torch\'s '
     'bf16 mm, re-scored exactly) on a random 384-d corpus as large as the last-level cache (20,000 to '
     '400,000 rows: an index that streams from memory, not one that sits in cache; round-robin, median of '
     '--reps calls) and keeps the fastest. Every path gives the same results; only speed changes.'),
    ('The table is cached under $RAGFAST_CACHE/topk_ip_choice/ (default ~/.cache/ragfast), keyed by CPU '
     'model and features, and from then on is preferred to a shipped table for this CPU (levels not '
     'measured keep the shipped cells). Without this command, a CPU with no shipped table calibrates once '
     'at its first default topk_ip call (RAGFAST_CALIBRATE=0 turns that off). To calibrate another ISA '
     'level, set RAGFAST_ISA. `ragfast backends` shows the table in use. Takes a few seconds to a minute, '
     'depending on the cache size and load.'),
))


def calibrate_cmd(
    reps: int = typer.Option(3, "--reps", help="Timed calls per path and cell (the median decides)."),
    as_json: bool = typer.Option(False, "--json", help="Print the cached table as JSON instead of a summary."),
) -> None:
    from rich.console import Console

    from ragfast.ops import topk_ip_choice
    from ragfast.ops.registry import available
    from ragfast.ops.topk_ip import calibrate_default_path, isa_level

    if reps < 1:
        raise ConfigError(f"--reps must be >= 1, got {reps}")
    if not available()["cpp"]:
        raise ConfigError("the compiled backend (ragfast._C) is not built here: topk_ip always takes the "
                          "torch path, there is nothing to calibrate")
    level = isa_level()
    err = Console(stderr=True)
    key = topk_ip_choice.machine_key()
    n = len(topk_ip_choice.BATCH_CLASSES) * 4
    err.print(f"calibrating topk_ip at ISA level {level} on {key['cpu']} ({n} cells, {reps} reps each)",
              highlight=False, soft_wrap=True)
    done = [0]

    def progress(storage: str, B: int, med: dict[str, float], best: str) -> None:
        done[0] += 1
        times = ", ".join(f"{p} {t * 1e3:.2f} ms" for p, t in sorted(med.items()))
        err.print(f"  [{done[0]:2d}/{n}] {storage:4s} B={B:<3d} {times} -> {best}", highlight=False, soft_wrap=True)

    cells = calibrate_default_path(reps=reps, progress=progress)
    table, path = topk_ip_choice.save_calibration(cells, f"ragfast calibrate --reps {reps}", explicit=True)
    if as_json:
        print(json.dumps(table, indent=1))
        return
    out = Console()
    out.print(f"wrote {path}", highlight=False, soft_wrap=True)
    for storage, per in cells[level].items():
        out.print(f"{level} {storage}: " + " ".join(f"B{b}:{p}" for b, p in per.items()),
                  highlight=False, soft_wrap=True)
    shipped = [t for t in topk_ip_choice.shipped_tables()
               if (t["cpu"], sorted(t["features"])) == (key["cpu"], key["features"])]
    if shipped and level in shipped[0]["cells"]:
        old = shipped[0]["cells"][level]
        diff = [f"{s} B{b}" for s, per in cells[level].items() for b, p in per.items() if old.get(s, {}).get(b) != p]
        out.print("differs from the shipped table for this CPU at: " + (", ".join(diff) if diff else "none"),
                  highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("calibrate", help=_HELP)(calibrate_cmd)
