"""Integration fixtures live in tests/conftest.py (shared with the reliability suite)."""
