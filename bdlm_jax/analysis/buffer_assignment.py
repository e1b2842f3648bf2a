"""XLA's buffer assignment of a compiled step, read from its dump: what the device allocates in
its own memory, and what of it is live at the step's peak.

`memory_analysis()` cannot say this where a step keeps buffers in host memory: XLA:TPU's
peak_memory_in_bytes counts the host-resident ones too (Qwen3.5-27B's conversion at 256K:
a 76 GB "peak" of which 56 GB sit in host memory), and its temp size mixes every memory space.
The buffer assignment says per allocation which memory it is in. Compiled with
`dump_options(folder)`, XLA:CPU and XLA:TPU (libtpu, ahead of time) both write to `folder`:

  *after_optimizations-buffer-assignment.txt  allocations (entry parameter N, output,
                                              preallocated temp, thread-local, constant; a
                                              memory space "color") and the values in each:
                                              offset, bytes as allocated (tiles included),
                                              shape and layout (S(5): host memory)
  *after_optimizations-live-range.txt         each value's live range: the steps of the
                                              flattened schedule (loop bodies inline, once)
                                              it is live at
  *after_optimizations-memory-usage-report.txt
                                              the memory spaces' names (default, host, and
                                              XLA:TPU's on-chip vmem, smem, ...)
  *after_optimizations-buffer-assignment-values.txt
                                              each value's defining instruction (analysis/
                                              buffers.py reads it to name what is live)

Two figures per compile (`DeviceMemory`):

  allocated  every allocation of the default memory space, whole: the entry parameters (the
             state and batch), the outputs not written into them, the preallocated temp
             block, constants and thread-local scratch. It is what the device must hold to
             run the step, and what a fit is judged by. On XLA:CPU it is the bound
             arguments + temp + output - alias plus the constants.
  live       the values of those allocations live at the one schedule step where they add up
             most (values sharing one allocation and offset, a loop's carry or an in-place
             update, counted once): the step's true high-water mark, at most `allocated`.
"""

import collections
import dataclasses
import glob
import os
import re

HOST_MEMORY_SPACE = 5  # xla::Layout::kHostMemorySpace: S(5) in a layout
DEFAULT_SPACE = "default"
HOST_SPACE = "host"

_RANGE_RE = re.compile(r"^\s+(\S+\{[\d,]*\}):(\d+)-(\d+)$", re.M)
_SPACE_RE = re.compile(r"^Memory Space: (\S+) \(color=(\d+)\)", re.M)
_ALLOCATION_RE = re.compile(r"^allocation (\d+): size (\d+), (.*):$")
_VALUE_RE = re.compile(
    r"^ value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
_ARRAY_RE = re.compile(r"^([a-z]\w*)\[([\d,]*)\]")
_MEMORY_SPACE_RE = re.compile(r"S\((\d+)\)")


def dump_options(folder: str) -> dict:
  """compiler_options that make XLA write the optimised module's buffer assignment to
  `folder` (`Lowered.compile(compiler_options=...)`)."""
  return {"xla_dump_to": folder, "xla_dump_hlo_as_text": True}


def dumped(folder: str, suffix: str) -> str:
  """The text of the one `*after_optimizations<suffix>` file XLA wrote to `folder`."""
  paths = glob.glob(os.path.join(folder, f"*after_optimizations{suffix}"))
  if len(paths) != 1:
    raise RuntimeError(f"expected one *after_optimizations{suffix} in {folder} (XLA's dump of "
                       f"the compiled step), found {len(paths)}")
  with open(paths[0]) as f:
    return f.read()


@dataclasses.dataclass(frozen=True)
class Value:
  """One value of the buffer assignment, with its live range and memory space."""
  name: str  # instruction{tuple index}, the live-range dump's spelling
  allocation: int
  kind: str  # parameter, temp, output, thread-local, constant
  space: str  # default, host, or an on-chip space's name
  offset: int
  nbytes: int  # as allocated: the target's tiled layout, padding included
  shape: str  # with layout
  first: int = -1
  last: int = -1


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
  """What the device's own memory holds for one compiled step (bytes per device)."""
  allocated_bytes: int
  live_bytes: int
  peak_step: int  # the schedule step where the live values add up most


def value_key(name: str) -> str:
  """The live-range dump's spelling of a value: `fusion.3{}` for `fusion.3`."""
  return name if name.endswith("}") else name + "{}"


def array(shape: str) -> tuple[str, tuple[int, ...], int]:
  """(dtype, dims, memory space) of a value's shape with layout; ('', (), 0) for a tuple."""
  m = _ARRAY_RE.match(shape)
  if not m:
    return "", (), 0
  space = _MEMORY_SPACE_RE.search(shape)
  dims = tuple(int(d) for d in m.group(2).split(",") if d)
  return m.group(1), dims, int(space.group(1)) if space else 0


def _allocation_kind(description: str) -> str:
  for kind in ("parameter", "thread-local", "constant", "preallocated-temp"):
    if kind in description:
      return "temp" if kind == "preallocated-temp" else kind
  return "output" if "live-out" in description else description


def _memory_spaces(text: str) -> dict:
  """{color: name} from the memory-usage report ("Memory Space: host (color=4)")."""
  return {int(m.group(2)): m.group(1) for m in _SPACE_RE.finditer(text)}


def _space(color: int, shape: str, spaces: dict) -> str:
  """A value's memory: host where its layout says S(5) (XLA:TPU may name that color
  otherwise), else its allocation's color's name."""
  if array(shape)[2] == HOST_MEMORY_SPACE:
    return HOST_SPACE
  return spaces.get(color, DEFAULT_SPACE if color == 0 else f"color {color}")


def read(folder: str) -> tuple[dict, list]:
  """({allocation: (bytes, kind, space)}, [Value]) of the step XLA dumped to `folder`; each
  value with its live range where it has one (-1, -1 where the live-range dump omits it)."""
  spaces = _memory_spaces(dumped(folder, "-memory-usage-report.txt"))
  ranges = {m.group(1): (int(m.group(2)), int(m.group(3)))
            for m in _RANGE_RE.finditer(dumped(folder, "-live-range.txt"))}
  allocations, values, current = {}, [], None
  for line in dumped(folder, "-buffer-assignment.txt").splitlines():
    m = _ALLOCATION_RE.match(line)
    if m:
      color = re.search(r"\bcolor (\d+)", m.group(3))
      current = int(m.group(1))
      allocations[current] = [int(m.group(2)), _allocation_kind(m.group(3)),
                              int(color.group(1)) if color else 0, []]
      continue
    m = _VALUE_RE.match(line)
    if m and current is not None:
      _, kind, color, shapes = allocations[current]
      name = value_key(m.group(1))
      shapes.append(m.group(4))
      values.append(Value(name, current, kind, _space(color, m.group(4), spaces),
                          int(m.group(3)), int(m.group(2)), m.group(4),
                          *ranges.get(name, (-1, -1))))
  # an allocation is in host memory where its values' layouts put them there
  by_allocation = {
      index: (nbytes, kind, HOST_SPACE if shapes and all(
          array(s)[2] == HOST_MEMORY_SPACE for s in shapes) else _space(color, "", spaces))
      for index, (nbytes, kind, color, shapes) in allocations.items()}
  return by_allocation, values


def peak(values: list) -> tuple[int, int]:
  """(step, bytes) where the live `values` add up most; values that share storage (one
  allocation at one offset: a loop's carry, an in-place update) count once, the largest."""
  events = collections.defaultdict(lambda: ([], []))
  for v in values:
    events[v.first][0].append(v)
    events[v.last][1].append(v)
  slots = collections.defaultdict(collections.Counter)  # (allocation, offset) -> size counts
  total, best = 0, (0, 0)

  def update(v, delta):
    nonlocal total
    sizes = slots[(v.allocation, v.offset)]
    before = max(sizes) if sizes else 0
    sizes[v.nbytes] += delta
    if not sizes[v.nbytes]:
      del sizes[v.nbytes]
    total += (max(sizes) if sizes else 0) - before

  for step in sorted(events):
    starting, ending = events[step]
    for v in starting:
      update(v, 1)
    if total > best[1]:
      best = (step, total)
    for v in ending:
      update(v, -1)
  return best


def live_device_values(values: list) -> list:
  """The values whose live ranges make the device's peak: those of the entry parameters,
  outputs and the temp block in the default memory space."""
  return [v for v in values if v.first >= 0 and v.space == DEFAULT_SPACE
          and v.kind in ("parameter", "temp", "output")]


def device_memory(folder: str) -> DeviceMemory:
  """The device's allocation and its live peak, from the dump in `folder`."""
  allocations, values = read(folder)
  step, live = peak(live_device_values(values))
  allocated = sum(nbytes for nbytes, _, space in allocations.values()
                  if space == DEFAULT_SPACE)
  return DeviceMemory(allocated, live, step)
