"""The kvprofile service."""
