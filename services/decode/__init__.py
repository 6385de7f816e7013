"""The decode service."""
