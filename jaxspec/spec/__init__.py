"""Speculative decoding: draft with an EAGLE-3 head, verify with the target, accept, commit — one jitted step."""
