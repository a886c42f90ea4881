"""Requests: turning an API body (and its headers) into one typed request: schemas, params, validation, deadlines."""
