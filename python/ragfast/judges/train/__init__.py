"""Training every judge of :mod:`ragfast.judges` (``ragfast train-judge --kind ...``).

- :mod:`~ragfast.judges.train.documents`: the bundled doc-set judge (``docset``) and the LoRA
  cross-encoder (``encoder``), on states built from supporting facts;
- :mod:`~ragfast.judges.train.head`: the frozen-feature head (``head``);
- :mod:`~ragfast.judges.train.causal`: LoRA SFT of a causal-LM judge (``causal``) on
  :mod:`~ragfast.judges.train.labelled` states, through :func:`ragfast.models.lora_sft.lora_sft`;
- :mod:`~ragfast.judges.train.lora`: the cross-encoder's LoRA layers.
"""
