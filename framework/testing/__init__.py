"""Test helpers for plugin authors: :mod:`framework.testing.conformance` (the conformance suite)."""
