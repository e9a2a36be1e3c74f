"""S2G stopping: a STOP judge in the Search-R1 loop, its replay evaluation, policy, labels and training."""
