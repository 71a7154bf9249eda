"""Automatic speculation (`--num-speculative-tokens auto`): the expected tokens/s of each method (config.py), this
machine's step costs timed (step_costs.py) and kept on disk (step_cost_store.py), and the generator that picks a
method before each batch (generator.py)."""
