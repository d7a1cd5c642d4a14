"""Primitive single-dim rules: where they come from (see registry.py for the order)."""

from decompshard.rules.registry import clear_cache, has_rule, rules_for, source_of

__all__ = ["clear_cache", "has_rule", "rules_for", "source_of"]
