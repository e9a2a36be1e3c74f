"""RELOOP's run settings."""
from __future__ import annotations

from dataclasses import dataclass

from ragfast.errors import ConfigError

__all__ = ["ReloopConfig"]


@dataclass
class ReloopConfig:
    """Settings of one RELOOP run.

    Attributes
    ----------
    planner : {"heuristic", "kg-path", "llm"}
    k : int
        Segments read per step.
    window : int
        Size of the sliding window (best unread candidates by dense score) the ``k`` are chosen from.
    max_steps : int
        Hard cap on iterator steps per question (refinement included).
    max_tokens : int
        Hard cap on the evidence pack, in whitespace tokens (:func:`ragfast.text.whitespace_tokens`).
    expand : bool
        Pull in structural context (paragraph lead sentence, cell headers) of every read segment.
    judge_threshold : float
        A state with STOP score >= this is sufficient.
    verify : bool
        Run the verifier and at most one refinement on a contradiction.
    refine_fraction : float
        Share of ``max_steps`` (at least one step) the refinement may use, within what is left.
    batch_size : int
        Questions iterated together (one encoder / judge / head call per step for all of them).
    max_pack_triples : int
        KG runs: triples kept in the evidence pack (the supporting edges of the best answers).
    plan_max_new_tokens, answer_max_new_tokens : int
        Generation caps of the LLM planner and of the head.
    """

    planner: str = "heuristic"
    k: int = 2
    window: int = 8
    max_steps: int = 4
    max_tokens: int = 400
    expand: bool = True
    judge_threshold: float = 0.0
    verify: bool = True
    refine_fraction: float = 0.5
    batch_size: int = 16
    max_pack_triples: int = 12
    plan_max_new_tokens: int = 96
    answer_max_new_tokens: int = 32

    def __post_init__(self) -> None:
        if self.planner not in ("heuristic", "kg-path", "llm"):
            raise ConfigError(f"unknown planner {self.planner!r}; expected heuristic, kg-path or llm")
        for name in ("k", "window", "max_steps", "max_tokens", "batch_size", "max_pack_triples", "plan_max_new_tokens",
                     "answer_max_new_tokens"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.window < self.k:
            raise ConfigError(f"window ({self.window}) must be >= k ({self.k})")
        if not 0 < self.refine_fraction <= 1:
            raise ConfigError(f"refine_fraction must be in (0, 1], got {self.refine_fraction}")
