"""Helpers the tests share (imported as tests.support.<module>; tests never import each other)."""
