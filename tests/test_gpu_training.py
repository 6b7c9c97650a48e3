"""GPU training checks: the trainer on CUDA (parameters, batches and noise on the device, NCCL),
bf16 against fp32, and the ``pretrain_xl`` recipe on mock latents. Skipped without CUDA."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dit_mcore.generate.preview import preview
from test_training import losses, tiny_run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[1]


def test_trainer_places_everything_on_the_gpu_and_bf16_tracks_fp32(tmp_path):
    from dit_mcore.training.trainer import Trainer

    fp32 = Trainer(tiny_run(tmp_path / "fp32", max_steps=8))
    assert fp32.device.type == "cuda"
    assert all(p.is_cuda for p in fp32.model.parameters())
    assert torch.distributed.get_backend() == "nccl"
    fp32_losses = losses(fp32.fit())
    cfg = tiny_run(tmp_path / "bf16", max_steps=8)
    cfg.trainer.bf16 = True
    bf16 = Trainer(cfg)
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in bf16.model.parameters())
    torch.testing.assert_close(torch.tensor(losses(bf16.fit())), torch.tensor(fp32_losses), rtol=3e-2, atol=0)


def test_pretrain_xl_on_mock_latents_50_steps(tmp_path):
    """The issue's acceptance command, shortened to 50 steps with a preview at the end."""
    run_dir = tmp_path / "xl"
    cmd = [sys.executable, "recipes/pretrain_xl.py", "--yes", "--factory", "pretrain_xl", "data.name=mock",
           "trainer.max_steps=50", "data.global_batch_size=32", "data.micro_batch_size=32", "log.log_interval=10",
           "log.samples_per_class=1", "diffusion.sample_steps=4", f"log.dir={run_dir}"]
    # A fresh single-process run: not the launch variables this pytest process set for its own world.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 50 and all(torch.isfinite(torch.tensor(m["loss"])) for m in lines)
    assert (run_dir / "samples" / "step_000050.png").is_file()


def test_a_distributed_optimizer_checkpoint_resumes_on_the_gpu(tmp_path):
    """megatron steps with torch's Adam (here its fused kernel; also where apex/TE is installed; the
    default on a GPU is the flat AdamW, a subclass), whose checkpoint load needs the fixes of
    ``dit_mcore.training.torch_optimizer`` on a GPU as on the CPU (and the fused kernel its ``step``
    tensors on the GPU); the resumed run continues the uninterrupted one (CUDA kernels need not be
    bitwise reproducible: close, not equal)."""
    from dit_mcore.training import torch_optimizer
    from dit_mcore.training.trainer import Trainer

    def fused(name):
        cfg = tiny_run(tmp_path / name, max_steps=6, distopt=True)
        cfg.optim.adam_impl = "fused"
        return cfg
    full = losses(Trainer(fused("full")).fit())
    cut = Trainer(fused("cut"))
    for _ in range(3):
        cut.train_step()
    cut.save()
    resumed = Trainer(fused("cut"))
    assert resumed.step == 3
    for inner in torch_optimizer.torch_adams(resumed.optimizer):  # fused AdamW: steps on the device after a load
        assert all(g["fused"] for g in inner.param_groups)
        assert all(s["step"].device.type == "cuda" for s in inner.state.values())
    torch.testing.assert_close(torch.tensor(losses(resumed.fit())), torch.tensor(full[3:]), rtol=1e-4, atol=1e-5)
    cfg = tiny_run(tmp_path / "cut", max_steps=6, distopt=True)  # the fused checkpoint, resumed foreach:
    cfg.optim.adam_impl = "foreach"                                # steps back on the host (no per-step reads)
    foreach = Trainer(cfg)
    for inner in torch_optimizer.torch_adams(foreach.optimizer):
        assert all(g["foreach"] and not g["fused"] for g in inner.param_groups)
        assert all(s["step"].device.type == "cpu" for s in inner.state.values())


def test_an_offloaded_ema_checkpoints_resumes_and_previews_on_the_gpu(tmp_path):
    """``trainer.ema_offload`` on CUDA, bf16: the shadow stays in host memory while the model trains
    on the GPU, equals the EMA kept on the GPU (the same steps: close, CUDA need not be bitwise), is
    checkpointed from the host and loaded back there, and a preview samples it on the GPU."""
    from dit_mcore.training.trainer import Trainer

    def run(name, offload):
        cfg = tiny_run(tmp_path / name, max_steps=4)
        cfg.trainer.bf16, cfg.trainer.ema_every, cfg.trainer.ema_offload = True, 2, offload
        return cfg
    on_gpu = Trainer(run("gpu", False))  # (run before the next Trainer rebuilds the process groups)
    on_gpu.fit()
    offloaded = Trainer(run("host", True))
    for _ in range(2):
        offloaded.train_step()
    offloaded.save()
    resumed = Trainer(run("host", True))
    assert all(p.device.type == "cpu" for p in resumed.ema.module.parameters())
    resumed.fit()
    for a, b in zip(on_gpu.ema.module.parameters(), resumed.ema.module.parameters()):
        torch.testing.assert_close(b, a.cpu(), rtol=1e-3, atol=1e-4)
    assert preview(resumed) is not None
    assert all(p.device.type == "cpu" for p in resumed.ema.module.parameters())


@pytest.mark.parametrize("offload", [False, True])
def test_a_sharded_ema_folds_checkpoints_resumes_and_previews_on_the_gpu(tmp_path, monkeypatch, offload):
    """``trainer.ema_shard=True`` on CUDA (one rank, distributed optimizer), bf16: the shadow is built
    on the meta device (megatron's layers would allocate on the GPU); the compiled fold over the buffer
    shards equals the replicated EMA (close: CUDA need not be bitwise); the shadow is gathered into host
    memory for the checkpoint (NCCL) and loaded back into the shards, and a preview gathers it on the
    GPU and frees it after. ``offload``: the shards in host memory, folded there from pinned copies of
    the rank's slices (side stream), gathered on the GPU."""
    from dit_mcore.training import ema_shards
    from dit_mcore.training.trainer import Trainer
    built, release = [], ema_shards.release
    monkeypatch.setattr(ema_shards, "release", lambda m: (built.append([p.is_meta for p in m.parameters()]),
                                                          release(m)))

    def run(name, shard):
        cfg = tiny_run(tmp_path / name, max_steps=4, distopt=True)
        cfg.trainer.bf16, cfg.trainer.ema_every, cfg.trainer.ema_shard = True, 2, shard
        cfg.trainer.ema_offload = offload and shard
        return cfg
    whole = Trainer(run("whole", False))  # (run before the next Trainer rebuilds the process groups)
    whole.fit()
    sharded = Trainer(run("sharded", True))
    assert built and all(built[0])  # (as built, before the first release)
    for _ in range(2):
        sharded.train_step()
    sharded.save()
    resumed = Trainer(run("sharded", True))
    assert resumed.step == 2 and all(s.is_cuda != offload for s in resumed.ema.shards.shards)
    resumed.fit()
    with resumed.ema.placed(torch.device("cpu")) as shadow:
        for a, b in zip(whole.ema.module.parameters(), shadow.parameters()):
            torch.testing.assert_close(b, a.cpu(), rtol=1e-3, atol=1e-4)
    assert preview(resumed) is not None
    assert all(p.is_meta for p in resumed.ema._module.parameters())


@pytest.mark.parametrize("compiled", [False, True])
def test_wgrad_accumulates_in_fp32_inside_the_gemm(compiled):
    """On the GPU, bf16 weight gradients accumulate into the fp32 ``main_grad`` inside cuBLAS
    (``addmm`` with ``out_dtype``, in place: the buffer is the GEMM's C and D): nearer the float64
    sum than the bf16 product added after (DDP hook's rounding), the buffer's storage unmoved."""
    from dit_mcore.kernels.wgrad_accumulation import accumulate_wgrad, mixed_addmm_accumulates

    device = torch.device("cuda")
    assert mixed_addmm_accumulates(device, torch.bfloat16, torch.float32), (
        f"torch {torch.__version__}: addmm cannot accumulate bf16 into an fp32 tensor in place; the fallback "
        "(bf16 product, then an add) runs")
    torch.manual_seed(0)
    g = [torch.randn(4, 512, 384, device=device).bfloat16() for _ in range(2)]
    x = [torch.randn(4, 512, 256, device=device).bfloat16() for _ in range(2)]
    buffer = torch.zeros(384 * 256 + 64, device=device)
    main_grad = buffer[32:32 + 384 * 256].view(384, 256)
    op = torch.compile(accumulate_wgrad, fullgraph=True) if compiled else accumulate_wgrad
    for gi, xi in zip(g, x):
        op(main_grad, gi, xi)
    exact = sum(gi.double().reshape(-1, 384).t() @ xi.double().reshape(-1, 256) for gi, xi in zip(g, x))
    hook = sum((gi.reshape(-1, 384).t() @ xi.reshape(-1, 256)).float() for gi, xi in zip(g, x))
    fused_err = (main_grad.double() - exact).abs().max().item()
    hook_err = (hook.double() - exact).abs().max().item()
    assert fused_err < hook_err / 4, (fused_err, hook_err)
    assert not buffer[:32].any() and not buffer[32 + 384 * 256:].any()


def test_a_batch_moves_to_the_gpu_without_blocking_the_host():
    """``MicroBatch.to(cuda)`` goes through pinned memory: the host queues the copies behind a busy
    stream and goes on (from pageable memory the driver may make it wait for the stream), and the
    device gets the batch's values."""
    import time

    from energon_data.batch import MicroBatch
    g = torch.Generator().manual_seed(0)
    batch = MicroBatch.packed(torch.randn(16000, 64, generator=g), torch.tensor([0, 5000, 16000]).int(),
                              torch.tensor([[1, 50, 100], [1, 100, 110]]), torch.tensor([3, 4]))
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # ~0.3 s of device time queued ahead of the copies
    begin = time.perf_counter()
    moved = batch.to("cuda")
    queued = time.perf_counter() - begin
    assert moved.tokens.is_cuda and moved.positions.is_cuda and not moved.grids.is_cuda
    assert queued < 0.1, f"the host waited {queued:.3f} s for the copies"
    torch.cuda.synchronize()
    assert torch.equal(moved.tokens.cpu(), batch.tokens) and torch.equal(moved.positions.cpu(), batch.positions)
