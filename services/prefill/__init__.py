"""The prefill service."""
