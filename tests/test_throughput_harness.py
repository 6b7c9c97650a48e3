"""benchmarks/throughput.py on CPU: one JSON line per point whose rates follow from its timing and
the trainer's FLOPs count; the autotuner finds the largest batch that fits."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import throughput  # noqa: E402
from family_models import count_params  # noqa: E402


def test_grid_writes_one_consistent_line_per_point(tmp_path):
    from dit_mcore.models.dit.config import preset
    from dit_mcore.models.registry import get_family
    from dit_mcore.models.flops import dit_flops

    out = tmp_path / "tp.jsonl"
    throughput.main(["--presets", "tiny", "--image-sizes", "8", "--batches", "2,4", "--accumulation", "1,2",
                     "--steps", "2", "--warmup", "1", "--peak-tflops", "0.5", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["batch"], r["accumulation"]) for r in rows] == [(2, 1), (2, 2), (4, 1), (4, 2)]
    cfg = preset("tiny")
    for r in rows:  # a step is `accumulation` micro-batches
        assert r["images_per_s"] == pytest.approx(r["batch"] * r["accumulation"] / r["step_s"])
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["images_per_s"] * 16)  # 8x8 latents, patch 2
        flops = dit_flops(cfg, [16] * r["batch"]).model * r["accumulation"]
        assert r["tflops_per_gpu"] == pytest.approx(flops / r["step_s"] / 1e12, rel=1e-5)
        assert r["mfu"] == pytest.approx(r["tflops_per_gpu"] / 0.5)
        assert r["command"].startswith("python benchmarks/throughput.py")
        assert r["warmup_steps"] == 1 and r["graphs_compiled_while_timed"] == 0 and r["alloc_retries_while_timed"] == 0
        host = r["host_ms_per_step"]  # the host's time per phase of a step: parts of the whole
        assert set(host) == set(throughput.HOST_PHASES) and 0 < host["train_step"] <= r["step_s"] * 1e3
        assert host["forward_backward"] + host["batch"] + host["to_device"] + host["grad_norm"] <= host["train_step"]
        assert r["state_gib"] == pytest.approx(count_params(get_family("dit"), "tiny")[0] * 20 / 2 ** 30)  # fp32: 20 B/param


def test_host_phases_count_the_host_time_of_each_part_of_a_step(monkeypatch):
    """``host_ms_per_step``: the time inside ``HostFold.wait`` (an offloaded EMA's fold) as ``waits``, the
    loader's batch, the micro-batches' copies, megatron's schedule, the gradient norm's read (the step's
    wait for the device) and the trainer's whole step, summed over the block; every function given back
    as it was (the instance's patches removed)."""
    import time

    from dit_mcore.training import trainer as trainer_module
    from dit_mcore.training.host_fold import HostFold
    from energon_data.batch import MicroBatch

    monkeypatch.setattr(HostFold, "wait", lambda fold: time.sleep(0.05))
    monkeypatch.setattr(MicroBatch, "to", lambda batch, device: time.sleep(0.02) or batch)
    monkeypatch.setattr(trainer_module, "get_forward_backward_func", lambda: lambda **kw: time.sleep(0.07))
    monkeypatch.setattr(trainer_module, "grads_and_norm", lambda optimizer: time.sleep(0.05) or 1.0)
    wait, to, schedule, norm = (HostFold.wait, MicroBatch.to, trainer_module.get_forward_backward_func,
                                trainer_module.grads_and_norm)

    class Loader:
        def next_global_batch(self):
            time.sleep(0.03)
            return [object.__new__(MicroBatch)]

    class Trainer:
        def __init__(self):
            self.loader = Loader()

        def train_step(self):
            batch = [b.to("cpu") for b in self.loader.next_global_batch()]
            trainer_module.get_forward_backward_func()(data=batch)
            trainer_module.grads_and_norm(None)
            object.__new__(HostFold).wait()
    trainer = Trainer()
    with throughput.host_phases(trainer) as host:
        trainer.train_step()
    assert 0.05 <= host["waits"] < 0.15 and 0.03 <= host["batch"] < 0.1 and 0.02 <= host["to_device"] < 0.1
    assert 0.07 <= host["forward_backward"] < 0.2 and 0.05 <= host["grad_norm"] < 0.15
    assert 0.22 <= host["train_step"] < 0.6  # batch + copies + schedule + norm + the fold's wait
    assert (HostFold.wait, MicroBatch.to, trainer_module.get_forward_backward_func, trainer_module.grads_and_norm) == (
        wait, to, schedule, norm)
    assert vars(trainer) == {"loader": trainer.loader} and not vars(trainer.loader)


def test_warm_up_goes_on_while_steps_still_compile(monkeypatch):
    """Packed batches change shape each step and dynamo compiles a dynamic graph at the second or third
    shape: the warm-up runs past its count while the last step compiled a graph (within a cap), so the
    timed steps compile nothing."""
    from torch._dynamo.utils import counters
    monkeypatch.setitem(counters, "stats", counters["stats"].copy())
    compiles_at = {0: 2, 1: 1, 2: 1}  # step -> graphs it compiles: the third step still compiles

    def step(i=[0]):
        counters["stats"]["unique_graphs"] += compiles_at.get(i[0], 0)
        i[0] += 1
    assert throughput.warm_up(step, 2) == 4  # steps 0-1, then 2 (compiled) and 3 (compiled nothing)
    assert throughput.warm_up(lambda: counters["stats"].update(unique_graphs=counters["stats"]["unique_graphs"] + 1),
                              1, most_extra=3) == 4  # a step that always compiles: capped


def test_ema_axes_reach_the_trainer_config(tmp_path):
    out = tmp_path / "tp.jsonl"
    throughput.main(["--presets", "tiny", "--image-sizes", "8", "--batches", "2", "--ema-every", "1,3",
                     "--ema-offload", "0,1", "--steps", "3", "--warmup", "1", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["ema_every"], r["ema_offload"]) for r in rows] == [(1, False), (1, True), (3, False), (3, True)]
    trainer = throughput.run_config(rows[3], str(tmp_path)).trainer
    assert trainer.ema_every == 3 and trainer.ema_offload


def test_moment_and_gradient_dtype_axes_reach_the_trainer_config(tmp_path):
    """``--moments``, ``--grads`` and ``--split-mains`` (bf16 gradient buffers and split main weights: bf16
    runs only, fp32 points keep fp32 ones)."""
    out = tmp_path / "tp.jsonl"
    throughput.main(["--presets", "tiny", "--image-sizes", "8", "--batches", "2", "--grads", "fp32,bf16",
                     "--split-mains", "0,1", "--moments", "bf16", "--steps", "2", "--warmup", "1", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["moments"], r["grads"], r["split_mains"]) for r in rows] == [("bf16", "fp32", False)]  # fp32 run
    optim = throughput.run_config(dict(rows[0], dtype="bf16", grads="bf16", split_mains=True), str(tmp_path)).optim
    assert optim.main_grads_dtype == "bf16" and optim.exp_avg_dtype == optim.exp_avg_sq_dtype == "bf16"
    assert optim.split_main_params


def test_te_fp8_recipes_reach_the_run_config(tmp_path, monkeypatch):
    """``--fp8 te:<recipe>``: Transformer Engine's FP8 (model.backend=te). The run config passes validation
    but for TE and the GPU themselves."""
    from dit_mcore.models import specs, te_fp8
    from dit_mcore.training.validate import run_problems
    monkeypatch.setattr(specs, "te_installed", lambda: True)
    monkeypatch.setattr(te_fp8, "check_machine", lambda *a: None)  # (its layout rules: checked)
    base = {"preset": "tiny", "image_size": 8, "packed_len": 0, "batch": 2, "recompute": "none", "compile": False,
            "dtype": "bf16"}
    for fp8, packed_len, backend, recipe in [("te:delayed", 0, "te", "delayed"), ("te:mxfp8", 512, "te", "mxfp8"),
                                             ("tensorwise", 512, "auto", "tensorwise")]:
        cfg = throughput.run_config(dict(base, fp8=fp8, packed_len=packed_len), str(tmp_path))
        assert (cfg.model.backend, cfg.model.fp8) == (backend, recipe)
        assert run_problems(cfg, world_size=1) == []


def test_compile_option_alternatives_parse_into_option_dicts():
    assert throughput.compile_option_sets("none;triton.multi_kernel=1,coordinate_descent_tuning=True;"
                                          "max_autotune_gemm_backends=TRITON") == [
        None, {"triton.multi_kernel": 1, "coordinate_descent_tuning": True}, {"max_autotune_gemm_backends": "TRITON"}]


def test_every_option_set_of_the_gpu_session_passes_validation_and_torch_compile(tmp_path):
    """The option sets benchmarks/gpu_session.sh hands throughput.py are checked here, before a lent
    GPU's minutes are spent on them: the run config's rules and torch.compile's own type checks."""
    import re


    from dit_mcore.training.validate import run_problems
    from test_training import tiny_run

    script = (Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.sh").read_text()
    sets = [opts for text in re.findall(r'--compile-options "([^"]+)"', script)
            for opts in throughput.compile_option_sets(text) if opts]
    assert sets
    for options in sets:
        cfg = tiny_run(tmp_path)
        cfg.model.compile, cfg.model.compile_options = True, options
        assert run_problems(cfg, world_size=1) == [], options
        torch.compile(lambda x: x + 1, options=options)  # raises on an unknown name or a wrong type


def test_autotune_finds_the_largest_batch_that_fits(monkeypatch):
    monkeypatch.setattr(throughput, "fits", lambda point: point["batch"] <= 37)
    assert throughput.autotune({"batch": 4}) == 37
    assert throughput.autotune({"batch": 37}) == 37
    with pytest.raises(RuntimeError, match="does not fit"):
        throughput.autotune({"batch": 64})


def test_kernel_profile_sorts_kernels_into_kinds_and_accounts_for_all_device_time():

    import kernel_profile
    names = {"nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_NNN": "gemm",
             "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": "attention",
             "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": "attention",
             "triton_red_fused__unsafe_view_add_gelu_gelu_backward_sum_2": "triton",
             "void at::native::_fused_adamw_kernel": "optimizer",
             "triton_poi_fused__to_copy_add_copy_copy__div_index_lerp_mul_ne_pow_0": "optimizer",  # flat AdamW
             "void at::native::reduce_kernel<128, 4, at::native::ReduceOp": "reduction",
             "void at::native::index_elementwise_kernel<128, 4>": "copy",
             "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add": "elementwise",
             "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "collective", "aten::addmm": "gemm"}
    assert {n: kernel_profile.kind_of(n) for n in names} == names
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    prof = kernel_profile.profile_steps(lambda n: [(a @ b).relu().sum() for _ in range(n)], torch.device("cpu"),
                                        n_steps=2)
    assert sum(k["share"] for k in prof["kinds"].values()) == pytest.approx(1.0)
    assert prof["top"][0]["ms_per_step"] >= prof["top"][-1]["ms_per_step"] and prof["busy"] is None
    assert "gemm" in prof["kinds"] and "ms/step" in kernel_profile.report("cpu", prof)


def _slow_host_part():
    import time
    time.sleep(0.01)


def test_the_host_profile_names_the_functions_a_step_spends_its_host_time_in():
    """``--host-profile``: the host's functions over the steps, by their own time per step; a step
    that sleeps 10 ms twice in one function shows it on top, called twice per step."""
    import kernel_profile

    def steps(n):
        for _ in range(n):
            _slow_host_part()
            _slow_host_part()
            sum(range(1000))
    rows = kernel_profile.host_profile_steps(steps, torch.device("cpu"), n_steps=3)
    top = next(r for r in rows if "_slow_host_part" in r["function"])
    assert top["calls_per_step"] == 2 and 19 <= top["total_ms_per_step"] < 60
    assert rows[0]["function"].endswith("sleep>") or "sleep" in rows[0]["function"]  # the sleep's own time
    assert rows == sorted(rows, key=lambda r: -r["own_ms_per_step"])
    assert "_slow_host_part" in kernel_profile.host_report(rows)


def test_a_point_frees_its_trainer_before_the_next_one(monkeypatch):
    """The next point of the same process must find the device empty: the trainer's parameters are held
    by reference cycles (DDP's hooks) until collected, and an H100 ran out of memory building a second
    MovieGen-3B point without the collection."""
    import weakref

    from dit_mcore.training import trainer as trainer_module
    refs, init = [], trainer_module.Trainer.__init__

    def watched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        refs.append(weakref.ref(next(self.model.parameters())))
    monkeypatch.setattr(trainer_module.Trainer, "__init__", watched)
    throughput.measure({"family": "dit", "preset": "tiny", "image_size": 8, "packed_len": None, "batch": 2,
                        "recompute": "none", "compile": False, "dtype": "fp32"}, 1, 1)
    assert len(refs) == 1 and refs[0]() is None


def test_the_host_overhead_benchmark_times_both_attention_placements(tmp_path):
    """``benchmarks/host_overhead.py``: the compiled packed text DiT's host time with packed attention
    outside the graph and as the planned operator, one JSON with their ratio (timing itself is the
    benchmark's, not asserted)."""
    import host_overhead

    out = tmp_path / "host.json"
    # (aot_eager: the same graphs, traced without Inductor's code generation, which test_compile covers)
    result = host_overhead.main(["--layers", "2", "--packed-len", "128", "--warmup", "2", "--steps", "1", "--repeats", "1",
                                 "--compile-backend", "aot_eager", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result)) and result["compile_backend"] == "aot_eager"
    for mode in ("outside", "planned"):
        assert 0 < result[mode]["forward_backward_ms"] <= result[mode]["step_ms"]
    assert result["ratio_outside_over_planned"] == pytest.approx(
        result["outside"]["forward_backward_ms"] / result["planned"]["forward_backward_ms"])
