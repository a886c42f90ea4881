"""Metrics, logs, redaction, health checks and watchdogs."""
