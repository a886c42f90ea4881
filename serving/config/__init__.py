"""Configuration: serving.properties, config.properties and the environment, parsed once into frozen dataclasses."""
