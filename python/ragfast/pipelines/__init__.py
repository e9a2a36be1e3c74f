"""Multi-round loops: searchr1, s2g, stepgap, reloop. Each is one module with a config dataclass."""
