"""The runner: the one factory (:mod:`~ragfast.runner.slots`) and the one driver (:mod:`~ragfast.runner.drive`).

It sits above the methods: it builds components from slot specs, hands them to a method's
loop, and owns the results directory, manifest, fingerprinted resume and progress.
"""
