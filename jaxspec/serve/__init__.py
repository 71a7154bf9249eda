"""`python -m jaxspec.serve`: an OpenAI-compatible HTTP server (app.py) over an engine thread (scheduler.py) that
continuously batches requests into the slots of one speculative generation state (jaxspec/engine/slots.py)."""
