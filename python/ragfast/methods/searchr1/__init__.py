"""Search-R1: the reasoner searches with <search>, reads <information>, answers in <answer>."""
