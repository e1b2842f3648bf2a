"""Deterministic cost figures read from a compiled JAX program.

Everything here takes ``compiled = jax.jit(f).lower(*args).compile()`` (a
``jax.stages.Compiled``); :func:`collective_bytes` also accepts the optimized
HLO text itself (``compiled.as_text()``), which is how hand-written HLO is
tested.

* :func:`collective_bytes` -- bytes moved per step, by collective kind, read from
  the optimized HLO text.
* :func:`total_collective_bytes` -- the sum of the above.
* :func:`wire_bytes` -- those operand bytes converted to what a device sends with ring
  algorithms, so all-gather and collective-permute transports compare on one scale.
* :func:`memory_stats` -- per-device buffer sizes from ``compiled.memory_analysis()``.
* :func:`flops` -- ``compiled.cost_analysis()['flops']``.
* :func:`dot_flops` -- the matmuls' FLOPs per step, loop trip counts multiplied in.

Byte convention (one device, one execution of the program)
-----------------------------------------------------------
Every collective instruction is charged the total size of its **operands** (the
data the device contributes), summed over tuple operands, times the number of
times it executes:

=====================  ===================================================
``all-gather``         the input shard (not the gathered result)
``reduce-scatter``     the full, unreduced input (not the scattered result)
``all-reduce``         the input (= the output size)
``collective-permute`` the buffer sent to the peer
``all-to-all``         the whole input (all the chunks, including the one
                       that stays on the device)
=====================  ===================================================

So an all-gather of an ``f32[8, 16]`` shard over 8 devices counts
``8 * 16 * 4 = 512`` bytes, and the reduce-scatter that is its transpose counts
``64 * 16 * 4 = 4096``. These are operand sizes, not bus/wire bytes: a ring
all-gather actually sends ``(P-1)/P`` of the output, etc. Compare strategies with
the same kind of collective, or convert with the algorithm's factor yourself.

Sizes are those of the *compiled* program, which is backend-specific: XLA:CPU
converts bf16 to f32 around every collective (``f32[64,16] all-gather(%wrapped_convert)``),
so on CPU a bf16 collective counts 4 bytes per element (f16 and s8 stay narrow);
GPU and TPU keep bf16 at 2 bytes.

How the HLO text is read
------------------------
* Async pairs are counted once, at the start: ``all-gather-start``,
  ``all-reduce-start``, ``collective-permute-start``, ``reduce-scatter-start``,
  ``all-to-all-start`` count their operands; ``*-update``/``*-done`` count
  nothing. A generic ``async-start(...), calls=%wrapped`` counts the collective
  inside ``%wrapped``; ``async-update``/``async-done`` (which may print the same
  ``calls=``) are not followed.
* Operands usually print as bare names (``all-gather(%param.1)``); their shapes
  come from the instruction or parameter that defines the name in the same
  computation. Operands printed with a shape (``all-gather(f32[8]{0} %p)``) use it.
* A collective executes as often as the computation holding it. Computations are
  reached from ``ENTRY`` through ``calls=`` (fusions, async wrappers),
  ``to_apply=`` (calls), ``body=``/``condition=`` (while), and conditional
  branches. A while body runs ``known_trip_count`` times (from the while's
  ``backend_config``, as XLA:CPU and XLA:GPU print it), its condition one time more;
  nested loops multiply. XLA:TPU prints no trip count: there it is read from the
  loop's own bounds, the condition's ``compare`` of the induction variable (the
  tuple element the body steps by a constant) with a constant or a loop-invariant
  element, from its initial value in the while's operand tuple. A loop with neither
  (a data-dependent bound) whose body holds collectives raises ``ValueError`` rather
  than guessing.
* XLA:TPU splits an async collective into pieces run by several fusions, possibly in
  different loops, that share a ``chain_id`` (frontend attribute): one collective, so a
  chain counts once, as often as the computation holding its least-run piece (a piece
  inside a data-dependent loop continues the transfer, it does not repeat it).
* XLA:TPU rewrites some collectives and prints them without an op_name: a small int32
  all-gather as an all-reduce (add) of buffers that are zeros but for the device's shard
  (a ``dynamic-update-slice`` into a ``broadcast`` of 0), counted as the all-gather it is
  (its shard's bytes); a reduce-scatter as an all-reduce (f32 in, bf16 out) of the full
  input and a slice, counted as that all-reduce (the same operand bytes).
* Conditional branches are all counted, as if each ran once (an upper bound).
* ``op_name`` keeps only collectives whose ``metadata={op_name="..."}`` contains it:
  ``"shard_map"`` selects what any ``shard_map`` issued; a ``jax.named_scope`` name selects
  what was traced inside that scope, forward and backward (``strategies.ATTENTION_SCOPE``).
  A collective with no op_name of its own takes that of the instruction computing what it
  moves (through copies, bitcasts, converts and fusions), else of those using its result.
* Not counted: ``send``/``recv``, ``collective-broadcast``,
  ``ragged-all-to-all``, and collectives hidden inside custom calls.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["COLLECTIVE_KINDS", "collective_bytes", "total_collective_bytes", "wire_bytes",
           "memory_stats", "flops", "dot_flops"]

COLLECTIVE_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute",
                    "all-to-all")

_DTYPE_BITS = {
    "pred": 8, "token": 0,
    "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
    "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
}

_MEMORY_FIELDS = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                  "alias_size_in_bytes", "generated_code_size_in_bytes")
# reported where the jax version has them: the compiler's own peak (meaningful on XLA:TPU and
# XLA:GPU; XLA:CPU's leaves out temp buffers) and host memory (offloaded buffers)
_OPTIONAL_MEMORY_FIELDS = ("peak_memory_in_bytes", "host_temp_size_in_bytes",
                           "host_argument_size_in_bytes", "host_output_size_in_bytes",
                           "host_alias_size_in_bytes", "host_generated_code_size_in_bytes")

# Attributes that name called computations: `calls=%f`, `body=%b`, `branch_computations={%a, %b}`.
_CALLEE_RE = re.compile(
    r"(?:^|[\s,])(calls|to_apply|body|condition|true_computation|false_computation|"
    r"branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_TRIP_COUNT_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_CHAIN_RE = re.compile(r'chain_id="([^"]+)"')
_INDEX_RE = re.compile(r"(?:^|[\s,])index=(\d+)")
_DIRECTION_RE = re.compile(r"direction=(\w+)")
_FLIPPED = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}  # a < b  <=>  b > a
_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_OP_NAME_RE = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


# ----------------------------------------------------------------------------- parsing

@dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: list[tuple[str | None, str]]  # (shape printed inline or None, name)
    attrs: str


@dataclass
class _Computation:
    name: str
    instrs: list[_Instr] = field(default_factory=list)
    shapes: dict[str, str] = field(default_factory=dict)  # instruction name -> shape
    defs: dict[str, _Instr] = field(default_factory=dict)  # instruction name -> instruction
    root: _Instr | None = None


def _matching(s: str, start: int) -> int:
    """Index of the bracket closing the one at ``s[start]`` (quote-aware)."""
    depth, in_str, i = 0, False, start
    while i < len(s):
        c = s[i]
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ValueError(f"unbalanced brackets in HLO line: {s!r}")


def _split_top_level(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    name, rest = m.group(1), m.group(2)
    if rest.startswith("("):                       # tuple shape: (f32[2], s32[])
        end = _matching(rest, 0) + 1
    else:                                          # array shape: f32[8,16]{1,0}
        end = rest.find(" ")
        if end < 0:
            return None
    shape, rest = rest[:end], rest[end:].lstrip()
    m = re.match(r"([\w\-]+)\(", rest)
    if not m:
        return None
    close = _matching(rest, m.end() - 1)
    operands = []
    for op in _split_top_level(rest[m.end():close]):
        op_shape, _, op_name = op.rpartition(" ")
        operands.append((op_shape.strip() or None, op_name.lstrip("%")))
    return _Instr(name, shape, m.group(1), operands, rest[close + 1:])


_QUOTED_RE = re.compile(r'"(?:[^"\\]|\\.)*"')


def _open_braces(line: str) -> int:
    unquoted = _QUOTED_RE.sub("", line)
    return unquoted.count("{") - unquoted.count("}")


def _logical_lines(text: str):
    """The HLO text's lines, each instruction whole: an attribute that spans lines (a Mosaic
    kernel's `frontend_attributes`) joins them, so none of its lines reads as a "}" closing
    the computation."""
    pending = []
    for raw in text.splitlines():
        if not pending and not (raw[:1].isspace() and raw.lstrip().startswith(("%", "ROOT "))):
            yield raw
            continue
        pending.append(raw)
        if _open_braces(" ".join(pending)) <= 0:
            yield " ".join(pending)
            pending = []
    if pending:
        yield " ".join(pending)


def _parse_module(text: str) -> tuple[dict[str, _Computation], str]:
    comps: dict[str, _Computation] = {}
    entry, cur = None, None
    for raw in _logical_lines(text):
        line = _COMMENT_RE.sub("", raw).strip()
        if cur is None:
            if line.endswith("{") and not line.startswith("HloModule"):
                m = _HEADER_RE.match(line)
                cur = comps[m.group(2)] = _Computation(m.group(2))
                if m.group(1):
                    entry = cur.name
        elif line.startswith("}"):
            cur = None
        else:
            instr = _parse_instr(line)
            if instr is not None:
                cur.instrs.append(instr)
                cur.shapes[instr.name] = instr.shape
                cur.defs[instr.name] = instr
                if line.startswith("ROOT "):
                    cur.root = instr
    if entry is None:
        raise ValueError("no ENTRY computation found in the HLO text")
    return comps, entry


# ----------------------------------------------------------------------------- sizes

def _dtype_bits(dtype: str) -> int:
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    m = re.fullmatch(r"f(\d+)e\d+m\d+\w*", dtype)  # f8e4m3fn, f8e5m2, f4e2m1fn, ...
    if m:
        return int(m.group(1))
    raise ValueError(f"unknown HLO element type {dtype!r}")


def _shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string; tuple shapes sum their elements."""
    total = 0
    for dtype, dims in _ARRAY_RE.findall(shape):
        n = math.prod(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
        total += -(-n * _dtype_bits(dtype) // 8)
    return total


def _collective_kind(opcode: str) -> str | None:
    """The kind counted for ``opcode``: a sync collective or the start of an async one."""
    base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
    return base if base in COLLECTIVE_KINDS else None


def _operand_bytes(instr: _Instr, comp: _Computation) -> int:
    total = 0
    for shape, name in instr.operands:
        if shape is None:
            if name not in comp.shapes:
                raise ValueError(f"operand %{name} of %{instr.name} is not defined in "
                                 f"computation %{comp.name}")
            shape = comp.shapes[name]
        total += _shape_bytes(shape)
    return total


# ----------------------------------------------------------------------------- call graph

def _callees(instr: _Instr) -> list[tuple[str, str]]:
    """(attribute, computation name) pairs called by ``instr``."""
    if instr.opcode in ("async-update", "async-done"):
        return []  # they repeat the async-start's `calls=`; the start is counted
    attrs = _STRING_RE.sub('""', instr.attrs)  # drop metadata / backend_config strings
    out = []
    for key, value in _CALLEE_RE.findall(attrs):
        for name in value.strip("{}").split(","):
            if name.strip():
                out.append((key, name.strip().lstrip("%")))
    return out


def _trip_count(instr: _Instr, caller: _Computation,
                comps: dict[str, _Computation]) -> int | None:
    """Iterations of the while ``instr``: its ``known_trip_count``, else its bounds."""
    m = _TRIP_COUNT_RE.search(instr.attrs)
    if m:
        return int(m.group(1))
    return _bounded_trip_count(instr, caller, comps)


def _source(comp: _Computation, name: str) -> _Instr | None:
    """The instruction behind ``name``, through copies, bitcasts and converts."""
    instr = comp.defs.get(name)
    while instr is not None and instr.opcode in ("copy", "bitcast", "convert"):
        instr = comp.defs.get(instr.operands[0][1])
    return instr


def _constant(instr: _Instr | None) -> int | None:
    if instr is None or instr.opcode != "constant":
        return None
    try:
        return int(instr.operands[0][1])
    except (IndexError, ValueError):
        return None


def _element(comp: _Computation, name: str) -> int | None:
    """i where ``name`` is element i of ``comp``'s tuple parameter, else None."""
    instr = _source(comp, name)
    if instr is None or instr.opcode != "get-tuple-element":
        return None
    param = comp.defs.get(instr.operands[0][1])
    m = _INDEX_RE.search(instr.attrs)
    return int(m.group(1)) if m and param is not None and param.opcode == "parameter" else None


def _bounded_trip_count(instr: _Instr, caller: _Computation,
                        comps: dict[str, _Computation]) -> int | None:
    """Iterations read from the loop's own bounds, as XLA:TPU leaves them: the
    condition's root compares the induction variable (element i, stepped by a constant
    in the body) with a constant or a loop-invariant element j; i's (and j's) initial
    value is a constant of the while's operand tuple. None for any other form."""
    attrs = dict(_callees(instr))
    cond, body = comps.get(attrs.get("condition")), comps.get(attrs.get("body"))
    init = _source(caller, instr.operands[0][1]) if instr.operands else None
    if cond is None or body is None or cond.root is None or body.root is None or \
            init is None or init.opcode != "tuple" or cond.root.opcode != "compare":
        return None
    direction = _DIRECTION_RE.search(cond.root.attrs)
    if direction is None or direction.group(1) not in _FLIPPED:
        return None

    def initial(i):
        return _constant(_source(caller, init.operands[i][1])) if i < len(init.operands) \
            else None

    def step(i):  # the body's new element i = element i + constant, else None
        new = _source(body, body.root.operands[i][1]) if i < len(body.root.operands) else None
        if new is None or new.opcode != "add":
            return None
        (_, a), (_, b) = new.operands
        for x, c in ((a, b), (b, a)):
            if _element(body, x) == i and _constant(_source(body, c)) is not None:
                return _constant(_source(body, c))
        return None

    def bound(name):  # a constant, or an element the body passes through unchanged
        value = _constant(_source(cond, name))
        j = _element(cond, name)
        if value is None and j is not None and j < len(body.root.operands) and \
                _element(body, body.root.operands[j][1]) == j:
            value = initial(j)
        return value

    (_, lhs), (_, rhs) = cond.root.operands
    op = direction.group(1)
    i = _element(cond, lhs)
    if i is None or step(i) is None:
        i, lhs, rhs, op = _element(cond, rhs), rhs, lhs, _FLIPPED[op]
    if i is None or step(i) in (None, 0):
        return None
    start, stride, limit = initial(i), step(i), bound(rhs)
    if start is None or limit is None:
        return None
    if op in ("LE", "GE"):
        limit += 1 if op == "LE" else -1
    span = limit - start if op in ("LT", "LE") else start - limit
    stride = stride if op in ("LT", "LE") else -stride
    return max(0, -(-span // stride)) if stride > 0 else None


def _execution_counts(comps: dict[str, _Computation],
                      entry: str) -> tuple[dict[str, int | None], dict[str, str]]:
    """(runs per execution of ENTRY by computation, None where a loop's trip count is
    unknown; for those, the loop that made it so)."""
    order, seen = [], set()

    def visit(name):  # post-order over the call graph (a DAG)
        seen.add(name)
        for instr in comps[name].instrs:
            for _, callee in _callees(instr):
                if callee not in seen:
                    visit(callee)
        order.append(name)

    visit(entry)
    counts: dict[str, int | None] = dict.fromkeys(order, 0)
    counts[entry], unknown = 1, {}
    for name in reversed(order):  # every caller before its callees
        comp = comps[name]
        for instr in comp.instrs:
            trips = _trip_count(instr, comp, comps) if instr.opcode == "while" else 1
            for key, callee in _callees(instr):
                times = None if trips is None or counts[name] is None else \
                    counts[name] * (trips + 1 if key == "condition" else trips)
                if times is None:
                    unknown.setdefault(callee, unknown.get(name, f"%{instr.name} in %{name}"))
                counts[callee] = None if times is None or counts[callee] is None \
                    else counts[callee] + times
    return counts, unknown


# ----------------------------------------------------------------------------- what moves

def _definition(comp: _Computation, name: str, comps: dict[str, _Computation],
                caller: tuple[_Instr, _Computation] | None = None):
    """(instruction, its computation, the fusion it sits in) that computes ``name``: through
    copies, bitcasts and converts, into a fusion's root, and from a fused parameter out to
    the fusion's operand (``caller``: the fusion and the computation holding it)."""
    instr = _source(comp, name)
    if instr is not None and instr.opcode == "fusion":
        fused = comps.get(dict(_callees(instr)).get("calls"))
        if fused is not None and fused.root is not None:
            return _definition(fused, fused.root.name, comps, (instr, comp))
    if instr is not None and instr.opcode == "parameter" and caller is not None:
        fusion, outer = caller
        index = int(instr.operands[0][1])
        if index < len(fusion.operands):
            return _definition(outer, fusion.operands[index][1], comps)
    return instr, comp, caller


def _gathered_shards(instr: _Instr, comp: _Computation, comps: dict[str, _Computation]):
    """[(computation, shard name)] where ``instr`` is an all-gather in the form XLA:TPU gives
    small int32 ones: an all-reduce (add) of buffers that are zeros but for this device's
    shard (``dynamic-update-slice`` into a ``broadcast`` of 0); else None."""
    reducer = comps.get(dict(_callees(instr)).get("to_apply"))
    if _collective_kind(instr.opcode) != "all-reduce" or reducer is None or \
            reducer.root is None or reducer.root.opcode != "add":
        return None
    shards = []
    for _, name in instr.operands:
        update, where, caller = _definition(comp, name, comps)
        if update is None or update.opcode != "dynamic-update-slice":
            return None
        base, base_comp, _ = _definition(where, update.operands[0][1], comps, caller)
        if base is None or base.opcode != "broadcast" or \
                _constant(_definition(base_comp, base.operands[0][1], comps)[0]) != 0:
            return None
        shards.append((where, update.operands[1][1]))
    return shards


def _op_name(instr: _Instr | None) -> str | None:
    m = _OP_NAME_RE.search(instr.attrs) if instr is not None else None
    return m.group(1) if m else None


def _users(comp: _Computation, name: str) -> list[_Instr]:
    """The instructions of ``comp`` that read ``name``, or an element of it."""
    direct = [i for i in comp.instrs if any(n == name for _, n in i.operands)]
    return [u for i in direct
            for u in (_users(comp, i.name) if i.opcode == "get-tuple-element" else [i])]


def _moved(instr: _Instr, comp: _Computation, comps: dict[str, _Computation]):
    """(kind, operand bytes, op_name) of the collective ``instr``. A collective XLA:TPU
    creates (an all-gather rewritten as an all-reduce, a reduce-scatter as an all-reduce and
    a slice) prints no op_name: it takes that of its operand (the reshape or copy that
    readies what it moves), else of the instruction computing that (a loop's result has
    none), else of those using what it delivers. An all-gather in all-reduce form
    (`_gathered_shards`) counts as the all-gather, its shard's bytes."""
    shards = _gathered_shards(instr, comp, comps)
    if shards is None:
        kind, nbytes = _collective_kind(instr.opcode), _operand_bytes(instr, comp)
        moved = [(comp, name) for _, name in instr.operands]
    else:
        kind, moved = "all-gather", shards
        nbytes = sum(_shape_bytes(where.shapes[name]) for where, name in shards)
    names = itertools.chain(  # lazily: most collectives name themselves
        [_op_name(instr)],
        (_op_name(where.defs.get(name)) for where, name in moved),
        (_op_name(_definition(where, name, comps)[0]) for where, name in moved),
        (_op_name(user) for user in _users(comp, instr.name)))
    return kind, nbytes, next((n for n in names if n is not None), None)


# ----------------------------------------------------------------------------- public API

def _hlo_text(compiled: Any) -> str:
    return compiled if isinstance(compiled, str) else compiled.as_text()


def collective_bytes(compiled: Any, op_name: str | None = None) -> dict[str, int]:
    """Bytes moved per device per execution, by collective kind.

    ``compiled`` is a ``jax.stages.Compiled`` or its optimized HLO text. Returns a
    dict with every kind in :data:`COLLECTIVE_KINDS` (0 when absent). Each
    collective is charged its operand bytes (the input shard for all-gather, the
    full input for reduce-scatter, the input for all-reduce, collective-permute and
    all-to-all) times the number of times it runs (while-loop trip counts
    multiply). With ``op_name``, only collectives whose metadata op_name contains
    it are counted. See the module docstring for the details.
    """
    comps, entry = _parse_module(_hlo_text(compiled))
    counts, unknown = _execution_counts(comps, entry)
    out = dict.fromkeys(COLLECTIVE_KINDS, 0)
    chains: dict[str, tuple[str, int, list]] = {}  # chain_id -> (kind, bytes, piece counts)
    for name, times in counts.items():
        comp = comps[name]
        for instr in comp.instrs:
            if _collective_kind(instr.opcode) is None:
                continue
            kind, nbytes, issued_by = _moved(instr, comp, comps)
            if op_name is not None and (issued_by is None or op_name not in issued_by):
                continue
            chain = _CHAIN_RE.search(instr.attrs)
            if chain:
                chains.setdefault(chain.group(1), (kind, nbytes, []))[2].append(times)
            elif times is None:
                raise ValueError(
                    f"while loop {unknown[name]} has collectives in %{name} but no "
                    f"known_trip_count in its backend_config and no bounds to read one from")
            else:
                out[kind] += times * nbytes
    for chain, (kind, nbytes, pieces) in chains.items():
        known = [t for t in pieces if t is not None]
        if not known:
            raise ValueError(f"collective chain {chain} runs only inside loops without a "
                             f"known trip count")
        out[kind] += min(known) * nbytes
    return out


def total_collective_bytes(compiled: Any) -> int:
    """Sum of :func:`collective_bytes` over all kinds."""
    return sum(collective_bytes(compiled).values())


def wire_bytes(by_kind: dict[str, int], num_devices: int) -> float:
    """Bytes one device sends for ``by_kind`` (operand bytes over a group of
    ``num_devices``) with ring algorithms: an all-gather sends its shard P-1 times,
    a reduce-scatter and an all-to-all (P-1)/P of their input, a collective-permute
    its buffer once, and an all-reduce (reduce-scatter + all-gather) 2(P-1)/P of it."""
    p = num_devices
    return (by_kind["all-gather"] * (p - 1) + by_kind["reduce-scatter"] * (p - 1) / p
            + by_kind["collective-permute"] + by_kind["all-to-all"] * (p - 1) / p
            + by_kind["all-reduce"] * 2 * (p - 1) / p)


def memory_stats(compiled: Any) -> dict[str, int]:
    """Per-device buffer sizes from ``compiled.memory_analysis()``.

    Keys: ``temp_size_in_bytes``, ``argument_size_in_bytes``,
    ``output_size_in_bytes``, ``alias_size_in_bytes``,
    ``generated_code_size_in_bytes``, plus ``peak_memory_in_bytes`` and the host
    memory sizes (``host_temp_size_in_bytes``, ...) where the jax version reports
    them. XLA:CPU's ``peak_memory_in_bytes`` leaves out temp buffers; XLA:TPU's is
    the compiler's own peak. Under SPMD the sizes are those of one device's shards.
    """
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError("this backend reports no memory analysis")
    if isinstance(stats, (list, tuple)):  # older jax: one entry per program
        (stats,) = stats
    out = {k: int(getattr(stats, k)) for k in _MEMORY_FIELDS}
    for k in _OPTIONAL_MEMORY_FIELDS:
        if getattr(stats, k, None) is not None:
            out[k] = int(getattr(stats, k))
    return out


_CONTRACTING_RE = re.compile(r"lhs_contracting_dims=\{([\d,\s]*)\}")
_DIM_LABELS_RE = re.compile(r"dim_labels=(\w+)_\w+->\w+")
_WINDOW_SIZE_RE = re.compile(r"window=\{[^}]*size=([\dx]+)")
_LHS_DILATE_RE = re.compile(r"window=\{[^}]*lhs_dilate=([\dx]+)")
_GROUPS_RE = re.compile(r"feature_group_count=(\d+)")


def _contracted(instr: _Instr, lhs_dims: list[int]) -> int:
    """Elements each output element of a `dot` or `convolution` sums over: the lhs's
    contracting dims; for a convolution (how XLA:TPU writes a matmul) its input features
    (the lhs's `f` label) times the window's taps that land on input elements, over its
    feature groups. XLA:TPU writes a batched matmul's batch axes as spatial ones whose
    window equals the lhs dilation (`size=2x8 lhs_dilate=2x8`): one tap each, not 16."""
    if instr.opcode == "dot":
        m = _CONTRACTING_RE.search(instr.attrs)
        axes = [int(a) for a in m.group(1).split(",") if a.strip()] if m else []
        return math.prod(lhs_dims[a] for a in axes)
    labels = _DIM_LABELS_RE.search(instr.attrs).group(1)
    window, dilate, groups = (r.search(instr.attrs)
                              for r in (_WINDOW_SIZE_RE, _LHS_DILATE_RE, _GROUPS_RE))
    sizes = [int(d) for d in window.group(1).split("x")] if window else []
    dilation = [int(d) for d in dilate.group(1).split("x")] if dilate else [1] * len(sizes)
    taps = math.prod(-(-w // d) for w, d in zip(sizes, dilation))
    return lhs_dims[labels.index("f")] * taps // (int(groups.group(1)) if groups else 1)


def _dims(shape: str) -> list[int]:
    dims = _ARRAY_RE.search(shape).group(2)
    return [int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip()]


def dot_flops(compiled: Any) -> tuple[float, float]:
    """(FLOPs, FLOPs per run inside loops of unknown trip count) of the program's ``dot``
    and ``convolution`` instructions (XLA:TPU writes matmuls as the latter), fused ones
    included, per execution: 2 x output elements x contracted
    elements each, times how often it runs (while-loop trip counts multiply, unlike
    :func:`flops`). Work in custom calls (Pallas/Mosaic kernels; on XLA:TPU `ragged_dot`'s
    forward and input gradient) is not seen; what XLA computes densely (XLA:TPU's
    `ragged_dot` weight gradient: every token against every expert) is counted as run. A loop whose
    trip count is data-dependent (the attention kernel's loop over the key chunks a query
    tile reaches) cannot be counted: its dots' FLOPs for one run of its body are the
    second figure."""
    comps, entry = _parse_module(_hlo_text(compiled))
    counts, _ = _execution_counts(comps, entry)
    known = unknown = 0.0
    for name, times in counts.items():
        comp = comps[name]
        for instr in comp.instrs:
            if instr.opcode not in ("dot", "convolution"):
                continue
            lhs_shape, lhs = instr.operands[0]
            lhs_dims = _dims(lhs_shape or comp.shapes[lhs])
            run = 2.0 * math.prod(_dims(instr.shape)) * _contracted(instr, lhs_dims)
            if times is None:
                unknown += run
            else:
                known += times * run
    return known, unknown


def flops(compiled: Any) -> float:
    """``compiled.cost_analysis()['flops']`` (a dict in new jax, a list of dicts in old).

    Caveat: XLA's cost analysis counts a while-loop body once, whatever its trip
    count (a 7-step ``fori_loop`` of matmuls reports about one matmul's flops).
    """
    analysis = compiled.cost_analysis()
    if analysis is None:
        raise RuntimeError("this backend reports no cost analysis")
    if isinstance(analysis, dict):
        analysis = [analysis]
    return float(sum(entry.get("flops", 0.0) for entry in analysis))
