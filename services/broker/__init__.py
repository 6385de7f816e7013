"""The broker service."""
