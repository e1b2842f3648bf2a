"""Which buffers a compiled train step holds at its memory peak, and what they are.

The step is compiled once more with XLA's dump options, and its buffer assignment read by
analysis/buffer_assignment.py (which files, which memory spaces, how the device's allocation
and live peak are read); this module says what the values live at that peak are.

`read_dump` sweeps the live ranges of the values in device memory (parameter, temp and output
allocations of the default space; values sharing one allocation and offset, a loop's carry
or an in-place update, count once) for the step where they add up most, and takes the values
live there, plus any in host memory (S(5) layouts, the host space): the peak. It does not use
the list the live-range dump prints as its peak: on XLA:TPU that list is another step (7.79
GB where the compiler's peak is 15.8, Llama-3-8B dims, 8 layers, 256K tokens, 16 v5p).
Each buffer goes into a category (`CATEGORIES`) by what the HLO says of it, first rule that
matches:

  host-resident       in host memory
  state / batch       in an entry parameter's allocation (the state, updated in place through
                      donation, or the batch); jax names the parameter in op_name
                      ("state.params[...]", "state.opt_state[...]", else batch and key)
  ring buffers        a collective-permute (the ring's K/V, metadata and dK/dV hops)
  loss chunk          a vocabulary-wide dim without d_model (or the two flattened): logits
  saved residuals     the layer scans' stacks: a leading dim that is a scan's length
                      (periods of the layer pattern, or a remainder run's layers), and the
                      rank's rows; named by their trailing dims (kernels/residuals.py:
                      attention_out [heads, head_dim], attention_lse [heads] in f32,
                      attention_exchanged_kv [kv heads, head_dim]; [d_model] the layer input,
                      the scan carry; [d_ff] an MLP intermediate, without remat)
  gradients, weights  the dims of a state parameter (up to order, size-1 dims, the layer
                      axis, and one dim gathered k-fold, k <= the devices): under
                      transpose(...) in op_name a gradient, else a gathered, cast or copied
                      weight (or a gradient whose op_name XLA dropped)
  MLP intermediates   a d_ff-wide dim (d_ff, 2 d_ff, an expert's moe_d_ff) beside the rows
                      (either order), or last
  attention           inside the attention shard_map (strategies.ATTENTION_SCOPE in op_name)
  activations         other buffers with the rank's rows; `other`: the rest

How robust that is: the peak, the bytes, the allocation kinds and the memory spaces are the
compiler's; the categories read from op_name (state, gradients, attention) hold while jax
names parameters and scopes as it does (0.10.x). The shape rules are the weak part: they hold
where d_model, d_ff, vocab, heads and the rows per rank differ (the 8B presets); where two
coincide (rows = 2 d_ff in a tiny model, attention_out reshaped flat to d_model) a buffer can
land in the neighbouring category. XLA:CPU's convert fusions and loop parameters carry no
op_name, so there the shape rules decide more often.

How the sum maps onto `memory_analysis()`: on XLA:TPU the device bytes at the peak are the
compiler's `peak_memory_in_bytes` (15.84 of 15.84 GB at the setting above:
experiments/results/memory_breakdown.md); a tiny step, whose arrays are smaller than a tile or
kept in on-chip memory, is well below it (0.29 at d_model 32 on 4 v5e chips). XLA:CPU
reports no peak of its own: there they are at most the bound arguments + temp + output -
alias (every buffer at once; 33.7 of 33.7 GB at the setting above), short of it by the temp
buffers not live at the peak, and the state and batch at the peak are the arguments but the
PRNG key.
"""

import collections
import dataclasses
import re
import tempfile

from bdlm_jax.analysis import buffer_assignment, step_report
from bdlm_jax.analysis.buffer_assignment import HOST_SPACE, array
from bdlm_jax.config import Config
from bdlm_jax.kernels import residuals
from bdlm_jax.models.transformer import scan_lengths
from bdlm_jax.parallel.registry import plan_for
from bdlm_jax.parallel.strategies import ATTENTION_SCOPE

GB = step_report.GB

HOST = "host-resident"
STATE = "state: parameters, optimizer state"
BATCH = "batch, key"
RING = "ring buffers (collective-permute)"
LOSS = "loss chunk (logits)"
GRADIENTS = "gradients"
WEIGHTS = "weight-shaped: gathered, cast, copied (no op_name says gradient)"
RESIDUALS = "saved residuals"
MLP = "MLP intermediates"
ATTENTION = "attention working memory"
ACTIVATIONS = "activations (other)"
OTHER = "other"
CATEGORIES = (STATE, BATCH, GRADIENTS, WEIGHTS, RESIDUALS, RING, ATTENTION, MLP, LOSS,
              ACTIVATIONS, HOST, OTHER)
LAYER_INPUT = "layer input (scan carry)"

_DEFINED_RE = re.compile(r"^<\d+ (\S+)(?: \(phi\))? @\d+>")
_INSTRUCTION_RE = re.compile(r"^ from instruction: %\S+ = .*? ([a-z][\w\-]*)\(")
_OP_NAME_RE = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass(frozen=True)
class Buffer:
  """One value live at the peak."""
  name: str  # the HLO value: instruction{tuple index}
  nbytes: int  # as allocated (XLA:TPU pads small arrays to its tiles)
  shape: str  # dtype[dims], e.g. bf16[4,1,8192,512]
  opcode: str
  op_name: str  # jax's metadata, "" where XLA's own fusion has none
  allocation: str  # parameter, output, temp, ... (the buffer assignment's kind)
  category: str
  residual: str = ""  # for saved residuals: which (kernels/residuals.py names)


@dataclasses.dataclass(frozen=True)
class Breakdown:
  """The buffers live at a compiled step's peak, and the compiler's memory figures."""
  buffers: tuple  # of Buffer, largest first
  report: step_report.StepReport  # memory_analysis() of the same compile
  platform: str  # cpu | tpu | gpu

  @property
  def device_bytes(self) -> int:
    """Bytes live at the peak in device memory (host-resident ones aside)."""
    return sum(b.nbytes for b in self.buffers if b.category != HOST)

  def by_category(self) -> dict:
    """{category: bytes live at the peak}, every category, in `CATEGORIES` order."""
    out = dict.fromkeys(CATEGORIES, 0)
    for b in self.buffers:
      out[b.category] += b.nbytes
    return out

  def by_residual(self) -> dict:
    """{residual name: bytes} of the saved residuals, largest first."""
    out = collections.Counter()
    for b in self.buffers:
      if b.category == RESIDUALS:
        out[b.residual] += b.nbytes
    return dict(out.most_common())

  def relation(self) -> str:
    """How the sum maps onto the compiler's own memory_analysis()."""
    r, live = self.report, self.device_bytes
    bound = (f"arguments {r.argument_bytes / GB:.3g} + temp {r.temp_bytes / GB:.3g} + output "
             f"{r.output_bytes / GB:.3g} - alias {r.alias_bytes / GB:.3g} = "
             f"{r.bound_bytes / GB:.3g} GB")
    if r.compiler_peak_bytes is not None:
      return (f"buffers live at the peak {live / GB:.3g} GB = {live / r.compiler_peak_bytes:.4f}"
              f" x the compiler's peak_memory_in_bytes {r.compiler_peak_bytes / GB:.3g} GB; "
              f"bound {bound}")
    return (f"buffers live at the peak {live / GB:.3g} GB = {live / r.bound_bytes:.3f} x the "
            f"bound {bound} (XLA:CPU reports no peak of its own; the rest of temp is not "
            "live at the peak)")

  def lines(self, top: int = 12) -> list[str]:
    """Markdown: the categories, the saved residuals by name, the `top` largest buffers."""
    live = self.device_bytes or 1
    out = [f"Memory at the peak ({self.relation()}).", "",
           "| category | GB | share | buffers | largest |", "|---|---|---|---|---|"]
    for category, nbytes in self.by_category().items():
      mine = [b for b in self.buffers if b.category == category]
      if mine:
        out.append(f"| {category} | {nbytes / GB:.3g} | {nbytes / live:.0%} | {len(mine)} | "
                   f"{mine[0].shape} |")
    stacks = self.by_residual()
    if stacks:
      out += ["", "Saved residuals (the layer scan's stacks): " + ", ".join(
          f"{name} {nbytes / GB:.3g} GB" for name, nbytes in stacks.items()) + "."]
    out += ["", f"The {min(top, len(self.buffers))} largest buffers live at the peak:", "",
            "| GB | shape | category | instruction | op_name (jax) |", "|---|---|---|---|---|"]
    for b in self.buffers[:top]:
      what = f"{b.category}: {b.residual}" if b.residual else b.category
      out.append(f"| {b.nbytes / GB:.3g} | {b.shape} | {what} | {b.name} ({b.opcode}) | "
                 f"{_short(b.op_name)} |")
    return out


def _short(op_name: str, keep: int = 70) -> str:
  op_name = op_name.replace("\\'", "'").replace("|", "/")
  return op_name if len(op_name) <= keep else "..." + op_name[-keep:]


def step_breakdown(cfg: Config, mesh) -> tuple:
  """(StepReport, Breakdown) of `cfg`'s train step from one compile on `mesh` (its
  devices' platform is the compiler, `step_report.step_report`)."""
  with tempfile.TemporaryDirectory(prefix="bdlm_buffers_") as folder:
    report = step_report.step_report(cfg, mesh, dump_to=folder)
    return report, read_dump(folder, cfg, report, mesh.devices.flat[0].platform)


def _definitions(text: str) -> dict:
  """{value: (opcode, op_name)} from the values dump's `from instruction:` lines."""
  out, value = {}, None
  for line in text.splitlines():
    m = _DEFINED_RE.match(line)
    if m:
      value = buffer_assignment.value_key(m.group(1))
    elif value and line.startswith(" from instruction:"):
      opcode = _INSTRUCTION_RE.match(line)
      op_name = _OP_NAME_RE.search(line)
      out[value] = (opcode.group(1) if opcode else "", op_name.group(1) if op_name else "")
  return out


@dataclasses.dataclass(frozen=True)
class _Dims:
  """The sizes that tell the step's buffers apart, from the config and its layout plan."""
  d_model: int
  vocab: int
  d_ff: tuple
  n_layers: int
  scan_lengths: tuple  # the layer scans' lengths: leading dims of their saved stacks
  rows: int  # per rank, both streams
  heads: int
  kv_heads: tuple
  head_dim: tuple
  n_devices: int

  @classmethod
  def of(cls, cfg: Config) -> "_Dims":
    m = cfg.model
    return cls(m.d_model, m.vocab_size, tuple({m.d_ff, 2 * m.d_ff, m.moe_d_ff or m.d_ff,
                                               2 * (m.moe_d_ff or m.d_ff)}),
               m.n_layers, tuple(scan_lengths(m)), plan_for(cfg).rows_per_rank, m.n_heads,
               tuple({m.n_kv_heads, m.global_n_kv_heads or m.n_kv_heads}),
               tuple({m.head_dim, m.global_head_dim or m.head_dim}),
               cfg.parallel.data * cfg.parallel.fsdp * cfg.parallel.seq)


def _weight_shaped(dims: tuple, weights: list, d: "_Dims") -> bool:
  """Whether `dims` are a state parameter's, up to order and size-1 dims, without its layer
  axis, or with one dim gathered k-fold, k <= the devices (ZeRO-3), into anything but the
  rank's rows."""
  mine = collections.Counter(n for n in dims if n > 1)
  for w in weights:
    for candidate in (w, w[1:] if w and d.n_layers % w[0] == 0 else None):
      if candidate is None:
        continue
      theirs = collections.Counter(n for n in candidate if n > 1)
      extra, missing = list((mine - theirs).elements()), list((theirs - mine).elements())
      if (not extra and not missing) or (len(extra) == len(missing) == 1
                                         and extra[0] % missing[0] == 0
                                         and extra[0] // missing[0] <= d.n_devices
                                         and extra[0] != d.rows):
        return bool(mine)
  return False


def _vocabulary_wide(dims: tuple, d: "_Dims") -> bool:
  """Logits: a vocabulary dim without d_model, or such a pair flattened into one dim."""
  if len(dims) == 1 and dims[0] % d.vocab == 0:
    return dims[0] // d.vocab != d.d_model
  return d.vocab in dims and d.d_model not in dims


def _mlp_wide(dims: tuple, d: "_Dims") -> bool:
  """An MLP intermediate: a d_ff-wide dim (not the rows themselves) beside the rows, or last."""
  rest = list(dims)
  if d.rows in rest:
    rest.remove(d.rows)
  return any(f in rest for f in d.d_ff) and (len(rest) < len(dims) or dims[-1] in d.d_ff)


def _residual_name(dtype: str, dims: tuple, d: _Dims) -> str:
  """Which saved residual a layer-scan stack is, by its trailing dims."""
  if dims[-1] == d.d_model:
    return LAYER_INPUT
  if dims[-1] in d.d_ff:
    return "MLP intermediate"
  if len(dims) >= 2 and dims[-1] in d.head_dim:
    return residuals.OUT if dims[-2] == d.heads else residuals.EXCHANGED
  if dtype == "f32" and d.heads in dims:
    return residuals.LSE
  return f"other ({dtype}[{','.join(map(str, dims[1:]))}] a layer)"


def _categorise(value, dtype, dims, host, kind, opcode, op_name, parameter_op_name, d, weights):
  """(category, residual name) of one buffer live at the peak (module docstring's rules)."""
  if host:
    return HOST, ""
  if kind == "parameter":
    return (STATE if parameter_op_name.startswith("state") else BATCH), ""
  if "collective-permute" in opcode or "collective-permute" in value or \
      op_name.endswith("ppermute"):
    return RING, ""
  if _vocabulary_wide(dims, d):
    return LOSS, ""
  if len(dims) > 2 and dims[0] > 1 and dims[0] in d.scan_lengths and d.rows in dims[1:]:
    return RESIDUALS, _residual_name(dtype, dims, d)
  if _weight_shaped(dims, weights, d):
    return (GRADIENTS if "transpose(" in op_name else WEIGHTS), ""
  if _mlp_wide(dims, d):
    return MLP, ""
  if ATTENTION_SCOPE in op_name:
    return ATTENTION, ""
  return (ACTIVATIONS if d.rows in dims else OTHER), ""


def read_dump(folder: str, cfg: Config, report: step_report.StepReport,
              platform: str) -> Breakdown:
  """The Breakdown of the step XLA dumped to `folder` (`buffer_assignment.dump_options`),
  compiled from `cfg`; `report`: the same compile's StepReport."""
  _, values = buffer_assignment.read(folder)
  defined = _definitions(buffer_assignment.dumped(folder, "-buffer-assignment-values.txt"))
  values = [v for v in values if v.first >= 0 and v.kind in ("parameter", "temp", "output")]
  step, _ = buffer_assignment.peak(buffer_assignment.live_device_values(values))
  at_peak = {}  # one value per storage slot live at the peak: the largest, then the first
  for v in sorted((v for v in values if v.first <= step <= v.last
                   and v.space in (buffer_assignment.DEFAULT_SPACE, HOST_SPACE)),
                  key=lambda v: (-v.nbytes, v.first)):
    at_peak.setdefault((v.allocation, v.offset), v)
  # each entry parameter's op_name (state.params[...], batch...) and dims, by allocation;
  # loop parameters aliased into its allocation are named under jit(...)
  parameters = {}
  for v in values:
    opcode, op_name = defined.get(v.name, ("", ""))
    if v.kind == "parameter" and opcode == "parameter" and "jit(" not in op_name:
      parameters[v.allocation] = (op_name, array(v.shape)[1])
  weights = [dims for op_name, dims in parameters.values() if op_name.startswith("state")]
  d = _Dims.of(cfg)
  out = []
  for v in at_peak.values():
    dtype, dims, _ = array(v.shape)
    opcode, op_name = defined.get(v.name, ("", ""))
    category, residual = _categorise(
        v.name, dtype, dims, v.space == HOST_SPACE, v.kind, opcode, op_name,
        parameters.get(v.allocation, ("", ()))[0], d, weights)
    out.append(Buffer(v.name, v.nbytes, v.shape.split("{")[0] if dims else "tuple", opcode,
                      op_name, v.kind, category, residual))
  out.sort(key=lambda b: -b.nbytes)
  return Breakdown(tuple(out), report, platform)
