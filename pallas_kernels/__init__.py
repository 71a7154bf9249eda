"""Pallas kernels, each beside a pure-jax.numpy reference with the same signature (tree attention, rejection sampling: issue 5)."""
