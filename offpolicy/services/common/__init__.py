"""Plumbing shared by both services: app factory, error envelope, health, metrics, settings."""
