"""FactTest (placeholder docstring, filled in below)."""
