"""count_comm(): calls and bytes of every wrapped op for known sizes, on 4 gloo ranks."""
import warnings

import torch
import torch.distributed as dist

from benchmarks.attention_comm import CommBenchConfig, analytic, measure, rows
from dist_utils import run_distributed
from dit_mcore.kernels.comm_counter import count_comm

F32 = 4


def _checks(rank, world):
    """Return ``[(label, measured, expected)]``; also results of the collectives themselves."""
    warnings.simplefilter("ignore", FutureWarning)  # *_tensor collectives are deprecated in favour of *_single
    P = world
    checks = []
    originals = {n: getattr(dist, n) for n in ("all_to_all_single", "isend", "batch_isend_irecv", "P2POp")}
    nxt, prv = (rank + 1) % P, (rank - 1) % P
    early_send = dist.P2POp(dist.isend, torch.ones(3), nxt)  # built before the patch
    early_recv = dist.P2POp(dist.irecv, torch.zeros(3), prv)

    with count_comm() as outer:
        def last():
            return outer.events[-1]

        x = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3) + 100 * rank
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x)
        checks.append(("a2a even", last().bytes_sent, 8 * 3 * F32 * (P - 1) // P))
        # the wrapped call still does the collective: block r of y comes from rank r's block `rank`
        checks.append(("a2a result", y[2 * prv:2 * prv + 2, 0].tolist(),
                       [float(100 * prv + 3 * (2 * rank + i)) for i in range(2)]))

        splits = [1, 2, 3, 2]
        out = torch.empty(P * splits[rank], 3)
        dist.all_to_all_single(out, x, [splits[rank]] * P, splits)
        checks.append(("a2a uneven", last().bytes_sent, (8 - splits[rank]) * 3 * F32))

        work = dist.all_to_all_single(y, x, async_op=True)
        work.wait()
        checks.append(("a2a async flag", last().async_op, True))

        dist.all_to_all([torch.zeros(2) for _ in range(P)], [torch.zeros(2) for _ in range(P)])
        checks.append(("a2a list", last().bytes_sent, (P - 1) * 2 * F32))

        dist.all_gather_into_tensor(torch.empty(P * 5), torch.ones(5))
        checks.append(("all_gather_into_tensor", last().bytes_sent, (P - 1) * 5 * F32))
        dist.all_gather_single(torch.empty(P * 5), torch.ones(5))
        checks.append(("all_gather_single", last().bytes_sent, (P - 1) * 5 * F32))
        dist.all_gather([torch.empty(5) for _ in range(P)], torch.ones(5))
        checks.append(("all_gather", last().bytes_sent, (P - 1) * 5 * F32))

        dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.float64), torch.ones(2 * P, dtype=torch.float64))
        checks.append(("reduce_scatter_tensor", last().bytes_sent, 2 * (P - 1) * 8))
        dist.reduce_scatter_single(torch.empty(2), torch.ones(2 * P))
        checks.append(("reduce_scatter_single", last().bytes_sent, 2 * (P - 1) * F32))
        dist.reduce_scatter(torch.empty(2), [torch.ones(2) for _ in range(P)])
        checks.append(("reduce_scatter", last().bytes_sent, 2 * (P - 1) * F32))

        t = torch.ones(10)
        dist.all_reduce(t)
        own = [3, 3, 2, 2][rank]  # tensor_split of 10 elements over 4 ranks
        checks.append(("all_reduce", last().bytes_sent, (10 - own) * F32 + (P - 1) * own * F32))
        checks.append(("all_reduce result", t[0].item(), float(P)))
        t = torch.ones(8)
        dist.all_reduce(t)
        checks.append(("all_reduce even = 2(P-1)/P n", last().bytes_sent, 2 * (P - 1) * 8 * F32 // P))

        dist.broadcast(torch.ones(6), src=0)
        checks.append(("broadcast", last().bytes_sent, (P - 1) * 6 * F32 if rank == 0 else 0))
        dist.reduce(torch.ones(6), dst=1)
        checks.append(("reduce", last().bytes_sent, 0 if rank == 1 else 6 * F32))
        dist.gather(torch.ones(6), [torch.empty(6) for _ in range(P)] if rank == 0 else None, dst=0)
        checks.append(("gather", last().bytes_sent, 0 if rank == 0 else 6 * F32))
        dist.scatter(torch.empty(6), [torch.ones(6) for _ in range(P)] if rank == 0 else None, src=0)
        checks.append(("scatter", last().bytes_sent, (P - 1) * 6 * F32 if rank == 0 else 0))

        with count_comm() as inner:  # nested block sees only its own calls, outer sees them too
            recv = torch.zeros(4)
            ops = [dist.P2POp(dist.isend, torch.full((4,), float(rank)), nxt), dist.P2POp(dist.irecv, recv, prv)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            checks.append(("batch_isend_irecv result", recv[0].item(), float(prv)))
            checks.append(("batch bytes", inner.summary(), {"batch_isend_irecv": {"calls": 1, "bytes_sent": 4 * F32}}))
            for w in dist.batch_isend_irecv([early_send, early_recv]):
                w.wait()
            checks.append(("batch of P2POps built before the patch", inner.bytes_sent("batch_isend_irecv"),
                           7 * F32))

        if rank % 2 == 0:
            dist.send(torch.ones(7), rank + 1)
            checks.append(("send", last().bytes_sent, 7 * F32))
            dist.isend(torch.ones(7), rank + 1).wait()
        else:
            dist.recv(torch.empty(7), rank - 1)
            checks.append(("recv", last().bytes_sent, 0))
            dist.irecv(torch.empty(7), rank - 1).wait()
        checks.append(("isend/irecv", last().bytes_sent, 7 * F32 if rank % 2 == 0 else 0))
        dist.barrier()
        checks.append(("barrier", (last().op, last().bytes_sent), ("barrier", 0)))

        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        singles = [dist.new_group([r]) for r in range(P)]
        dist.all_to_all_single(y, x, group=pairs[rank // 2])
        checks.append(("a2a on a pair", (last().bytes_sent, last().group_size), (8 * 3 * F32 // 2, 2)))
        dist.all_reduce(torch.ones(3), group=singles[rank])
        checks.append(("size-1 group sends nothing", last().bytes_sent, 0))

    checks.append(("outer saw the inner calls", outer.calls("batch_isend_irecv"), 2))
    checks.append(("summary totals", sum(v["bytes_sent"] for v in outer.summary().values()), outer.bytes_sent()))
    checks.append(("originals restored", all(getattr(dist, n) is f for n, f in originals.items()), True))
    return checks


def test_count_comm_bytes_and_calls_per_op():
    for rank, checks in enumerate(run_distributed(_checks, 4)):
        for label, got, want in checks:
            assert got == want, f"rank {rank}: {label}: measured {got}, expected {want}"


BENCH = CommBenchConfig(seq=64, heads=4, head_dim=4, degree=4, frames=8, chunks=2)


def _bench(rank, world):
    warnings.simplefilter("ignore", FutureWarning)
    return measure(rank, world, BENCH)


def test_benchmark_bytes_equal_the_analytic_formulas():
    table = rows(BENCH, run_distributed(_bench, BENCH.degree))
    assert {r["method"] for r in table} == set(BENCH.methods())
    for r in table:
        assert r["uniform_over_ranks"], r["method"]
        assert r["fwd_bytes"] == r["analytic_fwd_bytes"], (r["method"], r["fwd_bytes"], r["formula"])
        assert r["fwd_bwd_bytes"] == r["analytic_fwd_bwd_bytes"], (r["method"], r["fwd_bwd_bytes"])
    by = {r["method"]: r for r in table}
    # the note's headline: DSP's pair moves 1/4 of Ulysses' 2 layers (MHA: 8 vs 2 units of N C b / P)
    assert by["st_dsp"]["fwd_bytes"] * 4 == 2 * by["a2a"]["fwd_bytes"]
    assert by["st_dsp_overlap"]["fwd_ops"]["all_to_all_single"] == {"calls": 4, "bytes_sent": by["st_dsp"]["fwd_bytes"]}
    assert analytic("p2p", BENCH)[0] == 2 * 64 * 16 * 4 * 3 / 4  # 2 N C b (P-1)/P by hand


def test_uneven_split_sizes_may_be_numpy_arrays():
    """megatron's MoE dispatcher passes all_to_all_single split sizes as numpy arrays."""
    import numpy as np

    from dit_mcore.kernels.comm_counter import _own_block_bytes
    t = torch.zeros(5, 2)
    assert _own_block_bytes(t, np.array([3, 2]), 2, 1) == 2 * 2 * 4
    assert _own_block_bytes(t, [3, 2], 2, 0) == 3 * 2 * 4
    assert _own_block_bytes(torch.zeros(4, 2), None, 2, 0) == 2 * 2 * 4
