"""Helpers shared by test modules (importable as `helpers`: pytest puts tests/ on sys.path)."""
