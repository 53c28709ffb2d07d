"""advantages."""
