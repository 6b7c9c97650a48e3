"""EMA.update (one foreach lerp) equals the per-parameter formula exactly, with an fp32 shadow."""
import threading

import pytest
import torch

from dit_mcore.training.ema import EMA
from dit_mcore.training.host_fold import HostFold


def _net(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.Linear(7, 3)).to(dtype)


@pytest.mark.parametrize("offload", [False, True, "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_matches_per_parameter_lerp(dtype, offload, monkeypatch):
    """(``offload``: the fold runs on staged host copies in a thread; reading the shadow waits for it.
    ``"chunked"``: as under torchrun's one intra-op thread, in bounded chunks over a pool of threads.)"""
    if offload == "chunked":
        from dit_mcore.training import host_fold
        monkeypatch.setattr(host_fold, "CHUNK", 5)
        monkeypatch.setattr(host_fold, "host_workers", lambda: 3)
    elif offload:  # torch's intra-op threads parallelise each op (the suite's workers run one each): one fold thread
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    model = _net(dtype)
    ema = EMA(model, _net(dtype, seed=1), decay=0.9, offload=bool(offload))
    assert ema.host_fold is None or ema.host_fold.workers == (3 if offload == "chunked" else 1)
    reference = [p.detach().float().clone() for p in model.parameters()]
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in ema.module.parameters())
    for step in range(15):  # through the warm-up (decay_at < decay) and past it
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model, step)
        weight = 1.0 - min(0.9, (1.0 + step) / (10.0 + step))
        for r, p in zip(reference, model.parameters()):
            r.lerp_(p.detach().float(), weight)
        for r, e in zip(reference, ema.module.parameters()):
            assert torch.equal(r, e)


def test_folding_every_k_steps_equals_every_step_while_the_weights_hold_still():
    """``trainer.ema_every``: k steps noted, then one fold with the product of their decays, is the
    per-step average exactly when the weights did not move in between (float64 reference, through
    the warm-up); a fold with nothing noted changes nothing."""
    model, every_step = _net(), _net(seed=1)
    ema = EMA(model, _net(seed=2), decay=0.9)
    reference = [p.detach().double().clone() for p in model.parameters()]
    ema.fold(every_step)  # nothing noted: a no-op even with other weights
    assert all(torch.equal(r.float(), e) for r, e in zip(reference, ema.module.parameters()))
    k = 3
    for step in range(4 * k):
        if step % k == 0:  # the weights move once per block of k steps
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p))
        ema.note(step)
        if (step + 1) % k == 0:
            ema.fold(model)
            assert ema.unfolded_decay == 1.0
        decay = min(0.9, (1.0 + step) / (10.0 + step))
        for r, p in zip(reference, model.parameters()):
            r.mul_(decay).add_(p.detach().double(), alpha=1.0 - decay)
    for r, e in zip(reference, ema.module.parameters()):
        torch.testing.assert_close(e, r.float(), rtol=1e-6, atol=1e-6)
    assert max((r.float() - p.detach()).abs().max() for r, p in zip(reference, model.parameters())) > 0.1


def test_update_refuses_another_model():
    ema = EMA(_net(), _net(seed=1), decay=0.9)
    with pytest.raises(ValueError, match="model has 2 parameters but the EMA shadow 4"):
        ema.update(torch.nn.Linear(5, 7), 0)


def _fold_case(device):
    g = torch.Generator().manual_seed(0)
    sizes = [(7, 5), (7,), (3, 7), (1000,), (33, 17)]
    shadow = [torch.randn(s, generator=g).to(device) for s in sizes]
    params = [torch.randn(s, generator=g).to(device=device, dtype=torch.bfloat16) for s in sizes]
    return shadow, params


def test_a_fold_lerps_in_bounded_groups_and_equals_one_foreach_lerp(monkeypatch):
    """The fold casts a group of at most FOLD_GROUP parameters (besides the largest tensor) at a time, so
    its fp32 temporary stays bounded on a 3B model, and equals one foreach lerp over all of them bitwise."""
    from dit_mcore.training import ema as ema_module
    monkeypatch.setattr(ema_module, "FOLD_GROUP", 40)
    shadow, params = _fold_case("cpu")  # 35, 7, 21, 1000, 561 parameters
    want = [s.clone() for s in shadow]
    torch._foreach_lerp_(want, [p.float() for p in params], 0.3)
    groups, foreach = [], torch._foreach_lerp_

    def recorded(shadows, weights, weight):
        groups.append([t.numel() for t in shadows])
        return foreach(shadows, weights, weight)

    monkeypatch.setattr(torch, "_foreach_lerp_", recorded)
    ema_module._lerp(shadow, params, 0.3)
    assert groups == [[35, 7], [21, 1000], [561]]
    assert all(torch.equal(got, ref) for got, ref in zip(shadow, want))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_update_on_the_gpu_matches_per_parameter_lerp():
    model = _net(torch.bfloat16).cuda()
    ema = EMA(model, _net(torch.bfloat16, seed=1).cuda(), decay=0.9)
    reference = [p.detach().float().clone() for p in model.parameters()]
    for step in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model, step)
        weight = 1.0 - min(0.9, (1.0 + step) / (10.0 + step))
        for r, p in zip(reference, model.parameters()):
            r.lerp_(p.detach().float(), weight)
    for r, e in zip(reference, ema.module.parameters()):
        torch.testing.assert_close(e, r, rtol=1e-6, atol=1e-6)


def test_an_offloaded_fold_that_fails_is_raised_where_the_shadow_is_read_next(monkeypatch):
    """The host fold runs in a thread: its error must not vanish with it."""
    model = _net()
    ema = EMA(model, _net(seed=1), decay=0.9, offload=True)

    def broken(self, *args):
        raise ValueError("no lerp today")
    monkeypatch.setattr(torch.Tensor, "lerp_", broken)
    ema.update(model, 0)
    with pytest.raises(RuntimeError, match="host fold failed") as err:
        ema.module
    assert isinstance(err.value.__cause__, ValueError)
    monkeypatch.undo()
    ema.update(model, 1)  # the EMA goes on after the error was raised
    assert ema.module is not None


def test_a_host_fold_that_outlasts_the_steps_between_folds_is_named_once(monkeypatch, caplog):
    """When the next fold has to wait for the last host fold, training stalls: say so (once), with the fix."""
    import time
    model = _net()
    ema = EMA(model, _net(seed=1), decay=0.9, offload=True)
    lerp = torch.Tensor.lerp_
    monkeypatch.setattr(torch.Tensor, "lerp_", lambda self, *a: (time.sleep(0.05), lerp(self, *a))[1])
    with caplog.at_level("WARNING", logger="dit_mcore.training.host_fold"):
        for step in range(3):
            ema.update(model, step)
        ema.wait()
    assert caplog.text.count("raise trainer.ema_every") == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_offloaded_ema_stays_in_host_memory_and_equals_the_one_on_the_gpu():
    """``trainer.ema_offload`` on a GPU: the shadow lives on the host and folds bf16 weights copied to
    pinned buffers on a side stream, with the weights changed on the GPU right after each fold (behind
    :meth:`EMA.fence`, as the trainer's update is) and the host lerp waiting only for the copies' event
    (a 4096x4096 weight: copies of milliseconds); equal to the on-device EMA to fp32 rounding;
    :meth:`EMA.placed` runs it on the GPU and back."""
    def net(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(5, 4096), torch.nn.Linear(4096, 4096)).to(torch.bfloat16)
    model = net(0).cuda()
    on_gpu = EMA(model, net(1).cuda(), decay=0.9)
    offloaded = EMA(model, net(1).cuda(), decay=0.9, offload=True)
    assert all(p.device.type == "cpu" for p in offloaded.module.parameters())
    for step in range(6):
        offloaded.fence()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        on_gpu.update(model, step)
        offloaded.update(model, step)
    assert all(s.is_pinned() for s in offloaded.host_fold.staged)
    for a, b in zip(on_gpu.module.parameters(), offloaded.module.parameters()):
        torch.testing.assert_close(b, a.cpu(), rtol=1e-6, atol=1e-6)
    with offloaded.placed(torch.device("cuda")) as shadow:
        assert all(p.is_cuda for p in shadow.parameters())
        x = torch.randn(4, 5, device="cuda")
        torch.testing.assert_close(shadow(x), on_gpu.module(x), rtol=1e-4, atol=1e-4)
    assert all(p.device.type == "cpu" for p in offloaded.module.parameters())


def test_staged_copies_are_dropped_when_the_weights_may_change_and_a_fold_copies_again():
    """A fold lerps from the copies :meth:`HostFold.stage` queued, unless a fence (before an update) or
    a reader's wait came in between: then it copies the weights as they are (a fold never reads
    weights older than the last write)."""
    weight = torch.zeros(64)
    shadow = [torch.zeros(64)]
    fold = HostFold([weight])
    for drop in (None, "fence", "wait"):
        weight.fill_(1.0)
        fold.stage([weight])
        weight.fill_(5.0)  # as an update would, after the fence
        if drop is not None:
            getattr(fold, drop)()
        fold.start(shadow, [weight], 1.0)
        fold.wait()
        assert torch.equal(shadow[0], torch.full((64,), 1.0 if drop is None else 5.0)), drop
    # the trainer's stage never waits for a fold still running on the host: the fold copies instead
    release = threading.Event()
    fold._pending = threading.Thread(target=release.wait, args=(10,))  # a fold still lerping on the host
    fold._pending.start()
    fold.fence()
    weight.fill_(7.0)  # the update
    fold.stage([weight], block=False)  # returns at once, staging nothing
    assert fold._pending.is_alive() and not fold._staged
    release.set()
    fold.start(shadow, [weight], 1.0)  # waits for the fold before, then copies the weights as they are
    fold.wait()
    assert torch.equal(shadow[0], torch.full((64,), 7.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("side_sleep, fenced, expected", [(0, True, 1.0), (200_000_000, True, 1.0),
                                                          (200_000_000, False, 9.0)])
def test_staged_copies_start_where_queued_run_on_a_side_stream_and_are_fenced(side_sleep, fenced, expected):
    """The host fold's copies run on a side stream. Queued (:meth:`HostFold.stage`) while the compute
    stream is still busy before the weight's write (a sleep kernel), they start after that write: a
    copy that did not wait reads 0. :meth:`HostFold.fence` orders the next write after them: with the
    side stream held back longer than the compute stream, the fenced copy reads the written 1, and an
    unfenced one the later write's 9 (the race the fence exists for; with one hardware queue,
    ``CUDA_DEVICE_MAX_CONNECTIONS=1``, work is dispatched in submission order, and the unfenced write
    then overlaps the copy: either value, or both, may land)."""
    import os
    if not fenced and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        pytest.skip("one hardware queue: what the unfenced copy reads is not determined")
    weight = torch.zeros(1 << 20, device="cuda", dtype=torch.bfloat16)
    shadow = [torch.zeros(weight.shape)]
    fold = HostFold([weight])
    fold._stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the update still running when the copies are queued
    weight.fill_(1.0)
    if side_sleep:
        with torch.cuda.stream(fold._stream):
            torch.cuda._sleep(side_sleep)  # the copies queued behind this on their stream
    fold.stage([weight])
    fold.start(shadow, [weight], 1.0)  # from the staged copies
    if fenced:
        fold.fence()
    weight.fill_(9.0)  # the next update's write
    fold.wait()
    assert torch.equal(shadow[0], torch.full_like(shadow[0], expected)), shadow[0][:4]
