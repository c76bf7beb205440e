"""Integrations with training frameworks; each module imports its framework, so import only the one you use."""
