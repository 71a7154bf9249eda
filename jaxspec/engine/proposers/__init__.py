"""Draft proposers: the contract between the engine and a proposer (base.py), EAGLE-3 chains and trees (eagle3.py),
n-gram prompt lookup (ngram.py)."""
