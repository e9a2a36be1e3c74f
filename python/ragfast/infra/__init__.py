"""Plumbing every floor above may use: none of it knows what a question or a method is.

- :mod:`~ragfast.infra.http`: the one JSON-over-HTTP client of the remote components;
- :mod:`~ragfast.infra.devices`: where each model slot runs, checked up front;
- :mod:`~ragfast.infra.deps`: optional dependencies, imported with an error that says what to install;
- :mod:`~ragfast.infra.cache`: a least-recently-used mapping capped in bytes;
- :mod:`~ragfast.infra.ray_support`: the Ray module and an actor's device;
- :mod:`~ragfast.infra.logs` and :mod:`~ragfast.infra.progress`: the command line's logging and
  progress bars.
"""
