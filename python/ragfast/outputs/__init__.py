"""What a run leaves on disk, and how it reads back.

- :mod:`~ragfast.outputs.results`: crash-safe JSONL trajectories, one line per finished question,
  and the run's manifest;
- :mod:`~ragfast.outputs.failures`: a question whose component failed, as a record of its own;
- :mod:`~ragfast.outputs.slot_labels`: the manifest's slot labels (do a slot's answers mean anything?);
- :mod:`~ragfast.outputs.outdir`: an output directory a command that fails early leaves as it found it.
"""
