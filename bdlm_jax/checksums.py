"""File checksums, recorded when a file is written and compared when it is read back: the
shards of a prepared data folder and the files of a checkpoint. A file damaged at the same
size (a bad disk, a copy gone wrong) is otherwise read as valid data."""

import hashlib

from etils import epath

_CHUNK = 1 << 20  # bytes read at once: ~1.6 GB/s with SHA extensions, little memory


def sha256(path: epath.PathLike) -> str:
  """Hex sha256 of a file, a local path or a URL epath reads (`gs://...`)."""
  digest = hashlib.sha256()
  with epath.Path(path).open("rb") as f:
    while chunk := f.read(_CHUNK):
      digest.update(chunk)
  return digest.hexdigest()
