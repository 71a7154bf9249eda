"""Training EAGLE-3 heads (issue 6)."""
