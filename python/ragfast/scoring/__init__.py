"""Scoring answers and comparing methods.

- :mod:`~ragfast.scoring.metrics`: answer and retrieval metrics (EM, F1, recall);
- :mod:`~ragfast.scoring.stats`: statistics for paired method comparisons and for judging a
  STOP-score ranking (bootstrap intervals, AP, calibration).
"""
