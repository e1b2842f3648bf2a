"""hlo_stats reads collective bytes, memory and flops from compiled programs.

Every expected byte count is computed by hand from the per-device operand shape:
elements * bytes per element, times how many times the collective runs.
Runs on 8 simulated CPU devices (tests/conftest.py).
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from bdlm_jax.analysis.hlo_stats import (
    COLLECTIVE_KINDS, collective_bytes, dot_flops, flops, memory_stats, total_collective_bytes,
    wire_bytes)

N = 8  # devices on the 'x' axis
RING = [(i, (i + 1) % N) for i in range(N)]
F32, F16, BF16 = 4, 2, 2  # bytes per element


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= N
    return jax.make_mesh((N,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def compile_sharded(mesh, f, shard_shape, dtype=jnp.float32):
    """Compile shard_map(f) over 'x' for a global array made of N shards of `shard_shape`."""
    x = jnp.ones((N * shard_shape[0], *shard_shape[1:]), dtype)
    g = jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    return jax.jit(g).lower(x).compile()


def gather(a):
    return jax.lax.all_gather(a, "x", tiled=True)


def only(kind, nbytes):
    out = dict.fromkeys(COLLECTIVE_KINDS, 0)
    out[kind] = nbytes
    return out


# ----------------------------------------------------------------------------- one collective

def test_all_gather_counts_the_input_shard(mesh):
    c = compile_sharded(mesh, gather, (8, 16))
    assert collective_bytes(c) == only("all-gather", 8 * 16 * F32)  # 512, not the 4096 output


def test_ppermute_counts_the_buffer_sent(mesh):
    c = compile_sharded(mesh, lambda a: jax.lax.ppermute(a, "x", RING), (3, 5))
    assert collective_bytes(c) == only("collective-permute", 3 * 5 * F32)


def test_reduce_scatter_counts_the_full_input_not_the_scattered_output(mesh):
    # Its operand prints as a bare name (`reduce-scatter(%param.1)`): the shape comes
    # from the parameter that defines it.
    c = compile_sharded(mesh, lambda a: jax.lax.psum_scatter(a, "x", tiled=True), (8, 16))
    assert "reduce-scatter(%" in c.as_text()
    assert collective_bytes(c) == only("reduce-scatter", 8 * 16 * F32)  # output is [1, 16]


def test_psum_counts_its_input(mesh):
    c = compile_sharded(mesh, lambda a: jax.lax.psum(a, "x"), (8, 16))
    assert collective_bytes(c) == only("all-reduce", 8 * 16 * F32)


def test_all_to_all_counts_every_chunk_of_the_input_once(mesh):
    # XLA:CPU splits the input into N [1, 16] operands of one tuple-shaped all-to-all.
    c = compile_sharded(mesh, lambda a: jax.lax.all_to_all(a, "x", 0, 0, tiled=True), (8, 16))
    assert collective_bytes(c) == only("all-to-all", 8 * 16 * F32)


def test_f16_collectives_count_two_bytes_per_element(mesh):
    ag = compile_sharded(mesh, gather, (8, 16), jnp.float16)
    pp = compile_sharded(mesh, lambda a: jax.lax.ppermute(a, "x", RING), (8, 16), jnp.float16)
    assert collective_bytes(ag) == only("all-gather", 8 * 16 * F16)
    assert collective_bytes(pp) == only("collective-permute", 8 * 16 * F16)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU behaviour")
def test_cpu_runs_bf16_collectives_in_f32_and_the_bytes_say_so(mesh):
    # XLA:CPU converts bf16 to f32 around every collective (`all-gather(%wrapped_convert)`
    # with an f32 result): the compiled program moves 4 bytes per element, and that is
    # what is reported. GPU and TPU keep bf16 (2 bytes).
    ag = compile_sharded(mesh, gather, (8, 16), jnp.bfloat16)
    assert "f32[64,16]{1,0} all-gather(" in ag.as_text()
    assert collective_bytes(ag) == only("all-gather", 8 * 16 * F32)


def test_program_without_collectives_moves_nothing():
    c = jax.jit(lambda a: a * 2).lower(jnp.ones((4, 4))).compile()
    assert collective_bytes(c) == dict.fromkeys(COLLECTIVE_KINDS, 0)
    assert total_collective_bytes(c) == 0


def test_total_is_the_sum_over_kinds(mesh):
    def f(a):
        return jax.lax.psum(jax.lax.ppermute(a, "x", RING), "x")
    c = compile_sharded(mesh, f, (8, 16))
    shard = 8 * 16 * F32
    assert collective_bytes(c) == {**only("all-reduce", shard), "collective-permute": shard}
    assert total_collective_bytes(c) == 2 * shard


def test_gspmd_weight_gradient_all_reduce_is_counted():
    """Plain jit (no shard_map): a row-sharded matmul's weight gradient is all-reduced."""
    mesh = jax.make_mesh((N,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(jnp.ones((64, 16)), NamedSharding(mesh, P("x")))
    w = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P()))
    c = jax.jit(jax.grad(lambda w, x: jnp.sum(x @ w), argnums=0)).lower(w, x).compile()
    assert collective_bytes(c)["all-reduce"] == 16 * 32 * F32  # dW, replicated


def test_op_name_keeps_only_what_a_shard_map_issued(mesh):
    """A shard_map ring hop next to a GSPMD weight-gradient all-reduce: the filter splits them."""
    ring = jax.shard_map(lambda a: jax.lax.ppermute(a, "x", RING), mesh=mesh, in_specs=P("x"),
                         out_specs=P("x"))
    x = jax.device_put(jnp.ones((64, 16)), NamedSharding(mesh, P("x")))
    w = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P()))
    c = jax.jit(jax.grad(lambda w, x: jnp.sum(ring(x) @ w))).lower(w, x).compile()
    assert collective_bytes(c)["all-reduce"] == 16 * 32 * F32
    assert collective_bytes(c, "shard_map") == only("collective-permute", 8 * 16 * F32)


def test_wire_bytes_are_what_ring_algorithms_send():
    by_kind = {"all-gather": 10, "reduce-scatter": 80, "collective-permute": 3,
               "all-to-all": 16, "all-reduce": 8}
    assert wire_bytes(by_kind, 8) == 10 * 7 + 80 * 7 / 8 + 3 + 16 * 7 / 8 + 8 * 2 * 7 / 8


# ----------------------------------------------------------------------------- loops

def test_ppermute_in_a_7_step_fori_loop_counts_7_times(mesh):
    f = lambda a: jax.lax.fori_loop(0, 7, lambda i, c: jax.lax.ppermute(c, "x", RING) * 2.0, a)
    c = compile_sharded(mesh, f, (8, 16))
    assert c.as_text().count("collective-permute(") == 1  # printed once...
    assert collective_bytes(c) == only("collective-permute", 7 * 8 * 16 * F32)  # ...runs 7 times


def test_ppermute_in_a_7_step_scan_counts_7_times(mesh):
    def f(a):
        step = lambda c, _: (jax.lax.ppermute(c, "x", RING), None)
        return jax.lax.scan(step, a, None, length=7)[0]
    c = compile_sharded(mesh, f, (8, 16), jnp.float16)
    assert collective_bytes(c) == only("collective-permute", 7 * 8 * 16 * F16)


def test_nested_loops_multiply_trip_counts(mesh):
    def inner(c):
        return jax.lax.fori_loop(0, 5, lambda i, c: jax.lax.ppermute(c, "x", RING) * 2.0, c)

    def f(a):  # 3 outer steps, each: one psum and 5 ppermutes
        return jax.lax.fori_loop(0, 3, lambda j, c: inner(c) + jax.lax.psum(c, "x"), a)

    c = compile_sharded(mesh, f, (8, 16))
    shard = 8 * 16 * F32
    assert collective_bytes(c) == {**only("collective-permute", 3 * 5 * shard),
                                   "all-reduce": 3 * shard}


# ----------------------------------------------------------------------------- HLO text forms
# Formats the CPU backend does not emit (GPU async collectives, inline operand shapes),
# written the way XLA prints them.

ASYNC_HLO = """\
HloModule async_forms, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%async_wrapped (async_param: f32[64,16]) -> f32[8,16] {
  %async_param = f32[64,16]{1,0} parameter(0)
  ROOT %reduce-scatter.1 = f32[8,16]{1,0} reduce-scatter(%async_param), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
}

%body (p: (s32[], bf16[8,16])) -> (s32[], bf16[8,16]) {
  %p = (s32[], bf16[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[8,16]{1,0} get-tuple-element(%p), index=1
  %cp-start = (bf16[8,16]{1,0}, bf16[8,16]{1,0}) collective-permute-start(%x), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %cp-done = bf16[8,16]{1,0} collective-permute-done(%cp-start)
  ROOT %t = (s32[], bf16[8,16]{1,0}) tuple(%i, %cp-done)
}

%cond (q: (s32[], bf16[8,16])) -> pred[] {
  %q = (s32[], bf16[8,16]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[8,16], y: f32[64,16], z: bf16[8,16]) -> f32[64,16] {
  %x = f32[8,16]{1,0} parameter(0)
  %y = f32[64,16]{1,0} parameter(1)
  %z = bf16[8,16]{1,0} parameter(2)
  %ag-start = (f32[8,16]{1,0}, f32[64,16]{1,0}) all-gather-start(f32[8,16]{1,0} %x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, metadata={op_name="quoted text is ignored: calls=%async_wrapped"}
  %ag-done = f32[64,16]{1,0} all-gather-done(%ag-start)
  %ar-start = f32[64,16]{1,0} all-reduce-start(%ag-done), channel_id=2, to_apply=%add
  %ar-done = f32[64,16]{1,0} all-reduce-done(%ar-start)
  %rs-start = ((f32[64,16]{1,0}), f32[8,16]{1,0}, u32[]) async-start(%ar-done), calls=%async_wrapped
  %rs-done = f32[8,16]{1,0} async-done(%rs-start), calls=%async_wrapped
  %rs2-start = ((f32[64,16]{1,0}), f32[8,16]{1,0}) reduce-scatter-start(%y), channel_id=3, dimensions={0}, to_apply=%add
  %rs2-update = ((f32[64,16]{1,0}), f32[8,16]{1,0}) reduce-scatter-update(%rs2-start)
  %rs2-done = f32[8,16]{1,0} reduce-scatter-done(%rs2-update)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,16]{1,0}) tuple(%zero, %z)
  %loop = (s32[], bf16[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
  ROOT %out = f32[64,16]{1,0} all-gather(%rs-done), channel_id=5, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}
"""


def test_async_starts_count_once_and_dones_count_nothing():
    assert collective_bytes(ASYNC_HLO) == {
        "all-gather": 8 * 16 * F32 + 8 * 16 * F32,  # all-gather-start(inline shape) + all-gather
        "all-reduce": 64 * 16 * F32,                # all-reduce-start
        "reduce-scatter": 2 * 64 * 16 * F32,        # async-start wrapper + reduce-scatter-start
        "collective-permute": 7 * 8 * 16 * BF16,    # start inside a 7-trip while body
        "all-to-all": 0,
    }


def test_loop_with_collectives_and_unknown_trip_count_is_an_error():
    text = ASYNC_HLO.replace(', backend_config={"known_trip_count":{"n":"7"}}', "")
    with pytest.raises(ValueError, match="known_trip_count"):
        collective_bytes(text)


def test_tuple_operands_and_narrow_types_sum_their_sizes():
    text = """\
HloModule m

ENTRY %main (a: pred[10], b: s4[3], c: f8e4m3fn[2,2]) -> (pred[10], s4[3], f8e4m3fn[2,2]) {
  %a = pred[10]{0} parameter(0)
  %b = s4[3]{0} parameter(1)
  %c = f8e4m3fn[2,2]{1,0} parameter(2)
  ROOT %ar = (pred[10]{0}, s4[3]{0}, /*index=2*/f8e4m3fn[2,2]{1,0}) all-reduce(%a, %b, /*index=2*/%c)
}
"""
    assert collective_bytes(text)["all-reduce"] == 10 + 2 + 4  # s4[3]: 12 bits -> 2 bytes


# ----------------------------------------------------------------------------- memory and flops

def test_memory_stats_are_per_device(mesh):
    c = compile_sharded(mesh, gather, (8, 16))
    stats = memory_stats(c)
    assert {"temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
            "alias_size_in_bytes", "generated_code_size_in_bytes"} <= set(stats)
    assert all(isinstance(v, int) and v >= 0 for v in stats.values())
    assert stats["argument_size_in_bytes"] == 8 * 16 * F32   # one shard in
    assert stats["output_size_in_bytes"] == 64 * 16 * F32    # the gathered array out


def test_flops_of_a_matmul_is_2mnk():
    m, k, n = 4, 32, 16
    c = jax.jit(lambda x, w: x @ w).lower(jnp.ones((m, k)), jnp.ones((k, n))).compile()
    assert flops(c) == 2 * m * n * k


def test_dot_flops_multiply_a_loops_trip_count_and_set_aside_a_data_dependent_one():
    """cost_analysis counts a loop body once; dot_flops 7 times for 7 steps. A loop of
    data-dependent length (a traced bound) gives one run of its body apart."""
    x, w = jnp.ones((16, 64)), jnp.ones((64, 64))
    step = lambda i, x: jnp.tanh(x @ w)
    fixed = jax.jit(lambda x: jax.lax.fori_loop(0, 7, step, x)).lower(x).compile()
    assert dot_flops(fixed) == (7 * 2 * 16 * 64 * 64, 0.0)
    assert flops(fixed) < 2 * 2 * 16 * 64 * 64
    dynamic = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, step, x)).lower(x, 3).compile()
    assert dot_flops(dynamic) == (0.0, 2 * 16 * 64 * 64)


# XLA:TPU prints no known_trip_count: a loop's trips come from its bounds. `%scan` steps
# element 0 from 0 while it is below a constant 5; `%ring` steps it from 0 (through a copy)
# while element 2, passed through unchanged from its initial 3, is greater. A collective
# XLA:TPU splits into a chain of pieces (one chain_id) moves its bytes once, although a piece
# sits in a loop of data-dependent length (`%flash`, bounded by a parameter).
TPU_HLO = """\
HloModule tpu_forms, is_scheduled=true

%scan_body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0:T(8,128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %x = f32[8,16]{1,0:T(8,128)} get-tuple-element(%p), index=1
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i, %one)
  %cp = f32[8,16]{1,0:T(8,128)} collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  ROOT %t = (s32[]{:T(128)}, f32[8,16]{1,0:T(8,128)}) tuple(%next, %cp)
}

%scan_cond (q: (s32[], f32[8,16])) -> pred[] {
  %q = (s32[]{:T(128)}, f32[8,16]{1,0:T(8,128)}) parameter(0)
  %j = s32[]{:T(128)} get-tuple-element(%q), index=0
  %five = s32[]{:T(128)} constant(5)
  ROOT %lt = pred[]{:T(512)} compare(%j, %five), direction=LT
}

%ring_body (p: (s32[], bf16[4,16], s32[])) -> (s32[], bf16[4,16], s32[]) {
  %p = (s32[]{:T(128)}, bf16[4,16]{1,0}, s32[]{:T(128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %i.copy = s32[]{:T(128)} copy(%i)
  %x = bf16[4,16]{1,0} get-tuple-element(%p), index=1
  %n = s32[]{:T(128)} get-tuple-element(%p), index=2
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%one, %i.copy)
  %cp-start = (bf16[4,16]{1,0}, bf16[4,16]{1,0}, u32[]) collective-permute-start(%x), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %cp-done = bf16[4,16]{1,0} collective-permute-done(%cp-start)
  ROOT %t = (s32[]{:T(128)}, bf16[4,16]{1,0}, s32[]{:T(128)}) tuple(%next, %cp-done, %n)
}

%ring_cond (q: (s32[], bf16[4,16], s32[])) -> pred[] {
  %q = (s32[]{:T(128)}, bf16[4,16]{1,0}, s32[]{:T(128)}) parameter(0)
  %j = s32[]{:T(128)} get-tuple-element(%q), index=0
  %m = s32[]{:T(128)} get-tuple-element(%q), index=2
  ROOT %gt = pred[]{:T(512)} compare(%m, %j), direction=GT
}

%piece.0 (a: f32[2,16]) -> f32[8,16] {
  %a = f32[2,16]{1,0} parameter(0)
  ROOT %ag = f32[8,16]{1,0} all-gather(%a), channel_id=3, dimensions={0}, frontend_attributes={chain_id="0"}
}

%piece.1 (a: f32[2,16]) -> f32[8,16] {
  %a = f32[2,16]{1,0} parameter(0)
  ROOT %ag.1 = f32[8,16]{1,0} all-gather(%a), channel_id=3, dimensions={0}, frontend_attributes={chain_id="0"}
}

%flash_body (p: (s32[], f32[2,16], s32[])) -> (s32[], f32[2,16], s32[]) {
  %p = (s32[]{:T(128)}, f32[2,16]{1,0}, s32[]{:T(128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %w = f32[2,16]{1,0} get-tuple-element(%p), index=1
  %n = s32[]{:T(128)} get-tuple-element(%p), index=2
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i, %one)
  %more = f32[8,16]{1,0} fusion(%w), kind=kOutput, calls=%piece.1
  ROOT %t = (s32[]{:T(128)}, f32[2,16]{1,0}, s32[]{:T(128)}) tuple(%next, %w, %n)
}

%flash_cond (q: (s32[], f32[2,16], s32[])) -> pred[] {
  %q = (s32[]{:T(128)}, f32[2,16]{1,0}, s32[]{:T(128)}) parameter(0)
  %j = s32[]{:T(128)} get-tuple-element(%q), index=0
  %m = s32[]{:T(128)} get-tuple-element(%q), index=2
  ROOT %lt = pred[]{:T(512)} compare(%j, %m), direction=LT
}

ENTRY %main (x: f32[8,16], y: bf16[4,16], w: f32[2,16], k: s32[]) -> f32[8,16] {
  %x = f32[8,16]{1,0:T(8,128)} parameter(0)
  %y = bf16[4,16]{1,0} parameter(1)
  %w = f32[2,16]{1,0} parameter(2)
  %k = s32[]{:T(128)} parameter(3)
  %zero = s32[]{:T(128)} constant(0)
  %zero.copy = s32[]{:T(128)} copy(%zero)
  %three = s32[]{:T(128)} constant(3)
  %scan.init = (s32[]{:T(128)}, f32[8,16]{1,0:T(8,128)}) tuple(%zero, %x)
  %scan = (s32[]{:T(128)}, f32[8,16]{1,0:T(8,128)}) while(%scan.init), condition=%scan_cond, body=%scan_body
  %ring.init = (s32[]{:T(128)}, bf16[4,16]{1,0}, s32[]{:T(128)}) tuple(%zero.copy, %y, %three)
  %ring = (s32[]{:T(128)}, bf16[4,16]{1,0}, s32[]{:T(128)}) while(%ring.init), condition=%ring_cond, body=%ring_body
  %first = f32[8,16]{1,0} fusion(%w), kind=kOutput, calls=%piece.0
  %flash.init = (s32[]{:T(128)}, f32[2,16]{1,0}, s32[]{:T(128)}) tuple(%zero, %w, %k)
  %flash = (s32[]{:T(128)}, f32[2,16]{1,0}, s32[]{:T(128)}) while(%flash.init), condition=%flash_cond, body=%flash_body
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%scan), index=1
}
"""


def test_tpu_loops_read_trip_counts_from_their_bounds_and_chains_count_once():
    assert collective_bytes(TPU_HLO) == {
        **only("collective-permute", 5 * 8 * 16 * F32 + 3 * 4 * 16 * BF16),
        "all-gather": 2 * 16 * F32,  # the chain, once
    }


def test_an_attribute_spanning_lines_stays_inside_its_instruction():
    """A Mosaic kernel's custom call (Splash) prints its frontend_attributes over three lines,
    the last starting with "}}": the loop body it sits in keeps its root and its trips."""
    kernel = ('  %kernel = f32[8,16]{1,0} custom-call(%x), custom_call_target="tpu_custom_call", '
              'frontend_attributes={kernel_metadata={\n"xprof_metadata":"{\\"block_q\\": 128}"\n'
              '}}, backend_config={"custom_call_config":{"body":"TUzvUgFN"}}\n')
    text = TPU_HLO.replace("  %one = s32[]{:T(128)} constant(1)\n  %next = s32[]{:T(128)} add(%i, %one)\n"
                           "  %cp = ", "  %one = s32[]{:T(128)} constant(1)\n" + kernel +
                           "  %next = s32[]{:T(128)} add(%i, %one)\n  %cp = ", 1)
    assert "\n}}, backend_config" in text
    assert collective_bytes(text) == collective_bytes(TPU_HLO)


def test_a_chain_only_inside_a_data_dependent_loop_is_an_error():
    text = TPU_HLO.replace("  %first = f32[8,16]{1,0} fusion(%w), kind=kOutput, calls=%piece.0\n", "")
    with pytest.raises(ValueError, match="chain 0 runs only inside loops"):
        collective_bytes(text)


# XLA:TPU's rewrites of the all-gather transport, none with an op_name of its own: a small
# int32 all-gather becomes an all-reduce (add) of zeros but for this device's shard (a fused
# dynamic-update-slice into a broadcast 0), and the dK/dV reduce-scatter an all-reduce (f32
# in, bf16 out) of a slice. The first is the all-gather of its s32[32] shard, named by the
# attention ops that use it; the second takes the name of the slice that computes its input.
TPU_REWRITES_HLO = """\
HloModule tpu_rewrites, is_scheduled=true

%add (x: s32[], y: s32[]) -> s32[] {
  %x = s32[] parameter(0)
  %y = s32[] parameter(1)
  ROOT %sum = s32[] add(%x, %y)
}

%addf (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sumf = f32[] add(%a, %b)
}

%place (zeros: s32[128], offset: u32[], meta: s32[1,32]) -> s32[128] {
  %zeros = s32[128]{0} parameter(0)
  %meta = s32[1,32]{1,0} parameter(2)
  %flat = s32[32]{0} bitcast(%meta)
  %offset = u32[] parameter(1)
  ROOT %dus = s32[128]{0} dynamic-update-slice(%zeros, %flat, %offset)
}

ENTRY %main (meta: s32[1,32], offset: u32[], dkv: f32[1,160,2,16]) -> (s32[8,16], bf16[1,128,2,16]) {
  %meta = s32[1,32]{1,0} parameter(0)
  %offset = u32[] parameter(1)
  %dkv = f32[1,160,2,16]{3,2,1,0} parameter(2)
  %zero = s32[] constant(0)
  %zero.copy = s32[] copy(%zero)
  %zeros = s32[128]{0} broadcast(%zero.copy), dimensions={}
  %padded = s32[128]{0} fusion(%zeros, %offset, %meta), kind=kLoop, calls=%place
  %gathered = (s32[128]{0}) all-reduce(%padded), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  %rows = s32[128]{0} get-tuple-element(%gathered), index=0
  %keys = s32[8,16]{1,0} reshape(%rows), metadata={op_name="jit(f)/seq_attention/shard_map/reshape"}
  %mine = f32[1,128,2,16]{3,2,1,0} slice(%dkv), slice={[0:1], [32:160], [0:2], [0:16]}, metadata={op_name="jit(f)/transpose(jvp())/seq_attention/shard_map/slice"}
  %reduced = bf16[1,128,2,16]{3,2,1,0} all-reduce(%mine), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%addf
  ROOT %out = (s32[8,16]{1,0}, bf16[1,128,2,16]{3,2,1,0}) tuple(%keys, %reduced)
}
"""


def test_tpu_rewritten_collectives_count_as_what_they_stand_for_in_their_scope():
    expected = {**only("all-gather", 32 * 4), "all-reduce": 128 * 2 * 16 * F32}
    assert collective_bytes(TPU_REWRITES_HLO) == expected
    assert collective_bytes(TPU_REWRITES_HLO, "seq_attention") == expected


def test_an_all_reduce_of_a_buffer_not_all_zeros_stays_an_all_reduce():
    text = TPU_REWRITES_HLO.replace("s32[] constant(0)", "s32[] constant(1)")
    assert collective_bytes(text)["all-reduce"] == 128 * 4 + 128 * 2 * 16 * F32


# The dK/dV reduce-scatter of cp_allgather as XLA:TPU compiled it at 256K (Llama-3-8B, 16
# v5p): an all-reduce with no op_name, of a bitcast named in the attention scope, of the
# attention backward loop's result (a get-tuple-element: no op_name), read by a convert that
# XLA fused outside the scope. The bitcast names it.
LOOP_RESULT_HLO = """\
HloModule loop_result, is_scheduled=true

%addf (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sumf = f32[] add(%a, %b)
}

ENTRY %main (loop: (f32[1,128,2,16])) -> bf16[1,128,2,16] {
  %loop = (f32[1,128,2,16]{3,2,1,0}) parameter(0)
  %acc = f32[1,128,2,16]{3,2,1,0} get-tuple-element(%loop), index=0
  %ready = f32[1,128,2,16]{3,2,1,0} bitcast(%acc), metadata={op_name="jit(f)/transpose(jvp())/seq_attention/shard_map/reshape;transpose"}
  %reduced = f32[1,128,2,16]{3,2,1,0} all-reduce(%ready), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%addf
  ROOT %out = bf16[1,128,2,16]{3,2,1,0} convert(%reduced), metadata={op_name="jit(f)/transpose(jvp())/checkpoint/convert_element_type"}
}
"""


def test_a_rewritten_collective_of_a_loop_result_takes_the_name_of_its_operand():
  expected = only("all-reduce", 128 * 2 * 16 * F32)
  assert collective_bytes(LOOP_RESULT_HLO, "seq_attention") == expected
