"""The project's error type: the floor every other module may import."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix. Data, model,
    parallel and training checks all raise it, so a caller catches one type."""
