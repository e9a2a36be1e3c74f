"""The methods compared: ``ragfast bench``'s pipeline, its verdict and its report.

- :mod:`~ragfast.comparison.pipeline`: every registered method on the same questions through the
  runner, then the summary (paired differences against native Search-R1) and the files;
- :mod:`~ragfast.comparison.verdict`: does S2G pay, does StepGap pay, measured and projected;
- :mod:`~ragfast.comparison.report`: the side-by-side table, summary CSV, report.md/.html and plots.
"""
