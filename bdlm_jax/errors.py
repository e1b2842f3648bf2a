"""The package's error types, below every other module so any of them can raise one, and
what an OS error says in words."""

import os
import re


class ConfigError(ValueError):
  """A config key, value or combination that cannot run, or input that does not fit it."""


def cause(e: Exception) -> str:
  """What a failed write says in words: TensorStore's `[os_error_code='27']` (safetensors'
  `os error 27`) is "File too large", 28 "No space left on device"; else the first line of
  the error."""
  code = re.search(r"os[_ ]error(?:_code=)?'? ?(\d+)", str(e))
  return os.strerror(int(code.group(1))) if code else first_line(e)


def first_line(e: Exception, limit: int = 300) -> str:
  """One line: an error's first line, cut at `limit` characters (TensorStore's go on with
  the whole spec of the array they read)."""
  first = (str(e).strip().splitlines() or [""])[0].split(" See full TensorStore details")[0]
  text = f"{type(e).__name__}: {first}"
  return text if len(text) <= limit else text[:limit] + "..."
