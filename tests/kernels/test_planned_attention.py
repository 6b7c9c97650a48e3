"""The packed attention as one operator (``kernels.planned_attention``): the same output and
gradients as ``segment_attention`` (itself checked against float64), eagerly and inside
``torch.compile`` as a node of one graph; a new packing reuses the compiled graph; a plan that is no
longer kept is named; every context-parallel method in its planned form traced as one graph (gloo)."""
from __future__ import annotations

import pytest
import torch

from dit_mcore.kernels import segment_attention
from dit_mcore.kernels import planned_attention as pa
from test_local_attention import CASES, _inputs

PACKED = [name for name, case in CASES.items() if case[5] is not None]


def _out_and_grads(fn, q, k, v, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    (out * dout).sum().backward()
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("case", PACKED)
def test_the_planned_operator_equals_segment_attention_eager_and_compiled(case):
    b, s_q, s_kv, h, hk, segments = CASES[case]
    q, k, v, dout = _inputs(b, s_q, s_kv, h, hk, seed=5)
    ref_out, ref_grads = _out_and_grads(
        lambda *t: segment_attention(*t, segments=segments, return_lse=False), q, k, v, dout)
    plan = pa.plan(segments)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, plan: pa.planned_attention(q * 1.0, k, v, plan) * 2.0, fullgraph=True)
    for fn, scale in ((lambda *t: pa.planned_attention(*t, plan), 1.0), (lambda *t: compiled(*t, plan), 2.0)):
        out, grads = _out_and_grads(fn, q, k, v, dout)
        torch.testing.assert_close(out, ref_out * scale, rtol=1e-6, atol=1e-6)
        for got, ref in zip(grads, ref_grads):
            torch.testing.assert_close(got, ref * scale, rtol=1e-5, atol=1e-6)


def test_a_new_packing_reuses_the_compiled_graph():
    """The plan is a tensor: no guard on which packing it names, so a compiled graph takes any."""
    import torch._dynamo.utils

    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, plan: pa.planned_attention(q, k, v, plan).sum(), fullgraph=True)
    _, _, _, h, hk, first = CASES["runs_mixed_tail_pad"]
    q, k, v, _ = _inputs(1, 20, 20, h, hk)
    compiled(q, k, v, pa.plan(first))
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    from dit_mcore.kernels import Segments
    for cu in ([0, 10, 20], [0, 3, 6, 9, 12, 15, 18, 20], [0, 20]):
        segments = Segments.from_cu_seqlens(torch.tensor(cu), torch.tensor(cu))
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = compiled(q, k, v, pa.plan(segments))
        torch.testing.assert_close(got, segment_attention(q, k, v, segments=segments, return_lse=False).sum())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames


def test_a_plan_no_longer_kept_is_named(monkeypatch):
    monkeypatch.setattr(pa, "KEEP", 2)
    segments = CASES["runs_mixed_tail_pad"][5]
    old = pa.plan(segments)
    pa.plan(segments), pa.plan(segments)
    with pytest.raises(RuntimeError, match="no longer kept.*KEEP"):
        pa.segments_of(old)


def test_plans_are_made_outside_compiled_code_and_anew_for_new_params(monkeypatch):
    """A plan made while tracing would be a constant of the graph (every call the first packing):
    refused. Params made by ``dataclasses.replace`` with other segments get their own plan."""
    import dataclasses

    from dit_mcore.models.core_attention import KernelsPackedSeqParams
    first, other = CASES["runs_mixed_tail_pad"][5], CASES["padded_slots_varlen"][5]
    params = KernelsPackedSeqParams(qkv_format="sbhd", segments=first)
    assert pa.segments_of(params.plan) is first
    assert pa.segments_of(dataclasses.replace(params, segments=other).plan) is other
    assert KernelsPackedSeqParams(qkv_format="sbhd").plan is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match="outside compiled code"):
        pa.plan(first)


def test_forgotten_plans_are_named_when_read():
    plan = pa.plan(CASES["runs_mixed_tail_pad"][5])
    pa.forget_plans()
    with pytest.raises(RuntimeError, match="forget_plans"):
        pa.segments_of(plan)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["runs_mixed_tail_pad", "cross_layouts", "padded_slots_varlen", "shared_keys"])
def test_the_planned_operator_equals_segment_attention_on_the_gpu_in_bf16(case):
    """On CUDA the operator runs the varlen flash kernels (bf16) inside a compiled graph whose inputs
    mix CUDA tensors and the plan's host tensor: the same values as the autograd op's."""
    b, s_q, s_kv, h, hk, segments = CASES[case]
    q, k, v, dout = (t.cuda().bfloat16() for t in _inputs(b, s_q, s_kv, h, hk, d=64, seed=7))
    ref_out, ref_grads = _out_and_grads(
        lambda *t: segment_attention(*t, segments=segments, return_lse=False), q, k, v, dout)
    plan = pa.plan(segments)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, plan: pa.planned_attention(q, k, v, plan) * 1.0, fullgraph=True)
    out, grads = _out_and_grads(lambda *t: compiled(*t, plan), q, k, v, dout)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)  # bf16: the same kernels, summed in another order


def _cp_child(rank, world):
    """Every context-parallel method, dense and packed: the planned form compiled as one graph
    (``fullgraph``) against ``context_parallel_attention`` eagerly, this rank's out and gradients."""
    import torch._dynamo
    import torch.distributed as dist

    from dit_mcore.kernels import build_hybrid_groups, context_parallel_attention
    from dit_mcore.kernels.context_parallel import planned_context_parallel_attention

    wide, narrow = build_hybrid_groups(range(world), world), build_hybrid_groups(range(world), 1)
    methods = {"p2p": {}, "a2a": {}, "all_gather": {},
               "a2a+p2p wide": dict(a2a_group=wide[0], p2p_group=wide[1]),  # Ulysses over all, a ring of one
               "a2a+p2p narrow": dict(a2a_group=narrow[0], p2p_group=narrow[1])}  # a ring over all, Ulysses of one
    lens = [5, 1, 9, 3]  # packed: samples straddle the ranks' pieces, tail padding
    total, s_local = 20, 10
    starts = [sum(lens[:i]) for i in range(len(lens))]
    ends = [a + n for a, n in zip(starts, lens)]
    packed = pa.Segments(tuple(starts), tuple(ends), tuple(starts), tuple(ends))
    results = {}
    for name, groups in methods.items():
        method = name.split()[0]
        keys = {n: pa.group_key(g) for n, g in groups.items()}
        keys["cp_group"] = pa.group_key(dist.group.WORLD)
        for data, segments in (("dense", None), ("packed", packed)):
            g = torch.Generator().manual_seed(3)
            b = 2 if segments is None else 1
            q, k, v, dout = (torch.randn(b, total, n, 8, generator=g, dtype=torch.float64)[:, rank * s_local:
                                                                                           (rank + 1) * s_local]
                             for n in (4, 2, 2, 4))
            ref_out, ref_grads = _out_and_grads(
                lambda *t: context_parallel_attention(*t, method=method, cp_group=dist.group.WORLD,
                                                      segments=segments, **groups), q, k, v, dout)
            plan = pa.NO_SEGMENTS if segments is None else pa.plan(segments)
            torch._dynamo.reset()
            compiled = torch.compile(lambda q, k, v, plan: planned_context_parallel_attention(
                q, k, v, plan, method=method, cp_group=dist.group.WORLD, group_keys=keys, **groups),
                fullgraph=True, backend="aot_eager")
            out, grads = _out_and_grads(lambda *t: compiled(*t, plan), q, k, v, dout)
            results[name, data] = [(out - ref_out).abs().max().item()] + [
                (got - ref).abs().max().item() for got, ref in zip(grads, ref_grads)]
    return results


def test_planned_context_parallel_attention_is_one_graph_equal_to_the_eager_methods():
    """Ring and all-gather as the planned operator on a group key, Ulysses (and USP) with functional
    all-to-alls around it: traced without a break (``fullgraph``) and equal to the eager methods."""
    from dist_utils import run_distributed

    for rank, results in enumerate(run_distributed(_cp_child, 2)):
        assert len(results) == 10
        for case, errors in results.items():
            assert max(errors) < 1e-12, (rank, case, errors)
