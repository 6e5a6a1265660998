"""Offline builders of tiny random-init model folders for tests and demos (no model hub access)."""
