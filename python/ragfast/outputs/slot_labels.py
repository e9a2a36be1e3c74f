"""Slot labels from measurement: does a component's output mean anything in this run?

A slot's label must agree with the numbers of the same run:

- a scripted oracle is labelled for what it is (it knows the gold answers); random weights too;
- the STOP judge's verdict (does it rank validation states better than counting documents?) is
  measured with the study's stop AP in :mod:`ragfast.methods.s2g.doc_count`, above this floor.
"""
from __future__ import annotations

__all__ = ["ORACLE_LABEL", "RANDOM_LABEL", "EMPTY_LABEL"]

ORACLE_LABEL = "NO: knows the gold answers; EM = evidence reachability"
RANDOM_LABEL = "NO: random weights (exercises the compute path only)"
#: A slot a method asks for but nothing fills (``none``: StepGap's checker beside the scripted oracle).
EMPTY_LABEL = "empty: nothing runs in this slot"
