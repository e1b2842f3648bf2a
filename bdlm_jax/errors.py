"""The package's error types, below every other module so any of them can raise one."""


class ConfigError(ValueError):
  """A config key, value or combination that cannot run, or input that does not fit it."""
