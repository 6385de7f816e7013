"""Operator tools that are not services."""
