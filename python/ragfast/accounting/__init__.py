"""The cost model: what every component's compute costs, as measured, as served and as projected.

- :mod:`~ragfast.accounting.ledger`: the :class:`~ragfast.accounting.ledger.CostLedger`, one record
  stream for every component (``COMPONENTS``), with wall seconds, tokens and FLOPs;
- :mod:`~ragfast.accounting.flops`: analytic FLOPs of a transformer forward pass;
- :mod:`~ragfast.accounting.remote_cost`: the ``cost`` a server adds to its answers, booked by clients;
- :mod:`~ragfast.accounting.projection`: recorded work priced on a declared model and device;
- :mod:`~ragfast.accounting.savings`: does a checker pay for what it saves (paired bootstrap).
"""
