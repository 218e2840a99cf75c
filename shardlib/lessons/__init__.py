"""Measurements and plots that only the lesson notebooks use (the techniques live elsewhere)."""
