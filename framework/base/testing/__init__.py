"""Test helpers for plugin authors: :mod:`framework.base.testing.conformance` (the conformance suite)."""
