"""The device's own memory figures read from XLA's buffer-assignment dump (analysis/
buffer_assignment.py), on a dump written by hand in XLA's format: the allocation sums the
default memory space's allocations whole, the live peak sweeps their values' live ranges."""

from bdlm_jax.analysis import buffer_assignment as ba

# Allocations: 0 a parameter (state), 1 the preallocated temp block, 2 a constant, 3 a
# thread-local scratch, 4 host memory by its color's name, 5 host memory by its values'
# S(5) layout under another color's name (XLA:TPU calls it cmem), 6 on-chip vmem.
ASSIGNMENT = """\
BufferAssignment:
allocation 0: size 1000, parameter 0, shape |f32[250]| at ShapeIndex {}, maybe-live-out:
 value: <1 p0 @0> (size=1000,offset=0): f32[250]{0}
 value: <2 add.1 @0> (size=1000,offset=0): f32[250]{0}
allocation 1: size 5000, preallocated-temp:
 value: <3 fusion.1 @0> (size=3000,offset=0): f32[750]{0}
 value: <4 fusion.2 @0> (size=2000,offset=3000): f32[500]{0}
 value: <5 fusion.3 @0> (size=2500,offset=0): f32[625]{0}
allocation 2: size 64, constant:
 value: <6 constant.1 @0> (size=64,offset=0): f32[16]{0}
allocation 3: size 32, thread-local:
 value: <7 fusion.4 @0> (size=32,offset=0): f32[8]{0}
allocation 4: size 7000, color 4, preallocated-temp:
 value: <8 copy.1 @4> (size=7000,offset=0): f32[1750]{0}
allocation 5: size 9000, color 5, preallocated-temp:
 value: <9 copy.2 @5> (size=9000,offset=0): f32[2250]{0:S(5)}
allocation 6: size 400, color 1, preallocated-temp:
 value: <10 fusion.5 @1> (size=400,offset=0): f32[100]{0:S(1)}
"""
# fusion.1 and fusion.2 overlap at steps 3-4 (with p0: 6000 bytes); fusion.3 reuses
# fusion.1's slot later, with add.1 sharing p0's (an in-place update: counted once).
LIVE_RANGES = """\
HloLiveRange (max 9):
  InstructionSequence:
    0:p0
  BufferLiveRange:
    p0{}:0-5
    add.1{}:5-9
    fusion.1{}:1-4
    fusion.2{}:3-6
    fusion.3{}:7-9
    constant.1{}:0-9
    fusion.4{}:2-2
    copy.1{}:2-8
    copy.2{}:2-8
    fusion.5{}:3-3
"""
MEMORY_REPORT = """\
Memory Space: default (color=0)
Total bytes: 6096 (5.95KiB)
Memory Space: vmem (color=1)
Total bytes: 400 (400B)
Memory Space: host (color=4)
Total bytes: 7000 (6.8KiB)
Memory Space: cmem (color=5)
Total bytes: 9000 (8.8KiB)
"""


def dump(tmp_path):
  for suffix, text in (("-buffer-assignment.txt", ASSIGNMENT),
                       ("-live-range.txt", LIVE_RANGES),
                       ("-memory-usage-report.txt", MEMORY_REPORT)):
    (tmp_path / f"module_0000.jit_train_step.tpu_after_optimizations{suffix}").write_text(text)
  return str(tmp_path)


def test_the_allocation_is_the_default_spaces_allocations_whole(tmp_path):
  """1000 + 5000 + 64 + 32: the parameter, the whole temp block, the constant and the
  thread-local scratch; not the host allocations (by color name or by S(5) layout) nor
  vmem. It is the memory-usage report's own total of the default space."""
  allocations, _ = ba.read(dump(tmp_path))
  assert {i: space for i, (_, _, space) in allocations.items()} == {
      0: "default", 1: "default", 2: "default", 3: "default", 4: "host", 5: "host",
      6: "vmem"}
  memory = ba.device_memory(dump(tmp_path))
  assert memory.allocated_bytes == 6096


def test_the_live_peak_counts_overlapping_values_once_per_storage_slot(tmp_path):
  """Steps 3-4: p0 (1000) + fusion.1 (3000) + fusion.2 (2000) = 6000, the most; at step 5
  add.1 takes p0's slot (counted once) beside fusion.2: 3000; at 7-9 add.1 + fusion.3:
  3500. Constants, thread-local, host and vmem values are not in the sweep."""
  memory = ba.device_memory(dump(tmp_path))
  assert (memory.peak_step, memory.live_bytes) == (3, 6000)
  assert memory.live_bytes <= memory.allocated_bytes


def test_values_carry_their_memory_space_and_live_range(tmp_path):
  _, values = ba.read(dump(tmp_path))
  by_name = {v.name: v for v in values}
  assert (by_name["copy.2{}"].space, by_name["copy.1{}"].space) == ("host", "host")
  assert (by_name["fusion.5{}"].space, by_name["fusion.2{}"].space) == ("vmem", "default")
  assert (by_name["fusion.2{}"].first, by_name["fusion.2{}"].last) == (3, 6)
  assert [v.name for v in ba.live_device_values(values)] == [
      "p0{}", "add.1{}", "fusion.1{}", "fusion.2{}", "fusion.3{}"]
