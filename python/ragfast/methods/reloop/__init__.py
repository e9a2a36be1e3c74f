"""RELOOP: one reversible hierarchical sequence over text, tables and KGs, walked within a budget."""
