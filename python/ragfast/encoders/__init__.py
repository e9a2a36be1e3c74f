"""Encoders: the dense text encoder with its embedding caches, and the one ONNX exporter.

Below both :mod:`ragfast.retrieval` (which searches with an encoder) and :mod:`ragfast.models`
(whose judges embed documents with one), so neither of those imports the other for it.
:mod:`~ragfast.encoders.encoder` holds :class:`~ragfast.encoders.encoder.Encoder`, the byte-capped
embedding caches and corpus embedding; :mod:`~ragfast.encoders.export` the ONNX export and
sessions every encoder-shaped model (retrieval encoder, NLI cross-encoder) runs on.
"""
