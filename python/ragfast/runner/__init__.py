"""The runner: everything between a command's flags and a method's loop.

It sits above the methods: it builds components from slot specs, hands them to a method's
loop, and owns the results directory, manifest, fingerprinted resume and progress. One module a job:

- :mod:`~ragfast.runner.config_file`: the ``--config`` YAML file and the names it may use;
- :mod:`~ragfast.runner.settings`: the one :class:`~ragfast.runner.settings.RunSettings`;
- :mod:`~ragfast.runner.slots`: the one factory, a slot spec to a component;
- :mod:`~ragfast.runner.run_methods`: the one runner, :func:`~ragfast.runner.run_methods.run_methods`;
- :mod:`~ragfast.runner.recording`: recording a run: its fingerprint, resume check and writers;
- :mod:`~ragfast.runner.distributed` and :mod:`~ragfast.runner.ray_actors`: the Ray overlay.
"""
