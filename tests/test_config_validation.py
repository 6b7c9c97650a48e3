"""Every bad config fails before compute with one line naming ``section.field``, the value, the
rule and the fix (the table below), and nothing is written."""
import pytest

from dit_mcore.errors import ConfigError

from dit_mcore.models.dit.config import preset
from dit_mcore.training.trainer import Trainer
from dit_mcore.training.validate import config_sections, override_problem, run_problems, validate_run
from test_training import tiny_run

BAD = [  # (section, field, value, expected text of the one-line problem)
    ("optim", "lr", -1.0, "optim.lr=-1.0: must be a finite number > 0"),
    ("optim", "lr", float("nan"), "optim.lr=nan: must be a finite number > 0"),
    ("optim", "min_lr", 1.0, "optim.min_lr=1.0: must be in [0, optim.lr=0.001]"),
    ("optim", "warmup_steps", 4, "optim.warmup_steps=4: must be < trainer.max_steps=4"),
    ("optim", "decay_style", "cosin", "did you mean 'cosine'?"),
    ("optim", "adam_beta2", 1.0, "optim.adam_beta2=1.0: must be in [0, 1)"),
    ("optim", "adam_eps", 0.0, "optim.adam_eps=0.0: must be > 0"),
    ("optim", "clip_grad", -1.0, "optim.clip_grad=-1.0: must be >= 0 (0: no clipping)"),
    ("optim", "lr", "fast", "optim.lr='fast': must be of type float"),
    ("trainer", "max_steps", -5, "trainer.max_steps=-5: must be >= 1"),
    ("trainer", "save_interval", 0, "trainer.save_interval=0: must be >= 1"),
    ("trainer", "ema_decay", 1.0, "trainer.ema_decay=1.0: must be in [0, 1)"),
    ("trainer", "ema_every", 0, "trainer.ema_every=0: must be >= 1"),
    ("trainer", "keep_checkpoints", -1, "trainer.keep_checkpoints=-1: must be >= 0 (0: keep all)"),
    ("trainer", "max_skipped_steps", 0, "trainer.max_skipped_steps=0: must be >= 1"),
    ("trainer", "bf16", "yes", "trainer.bf16='yes': must be of type bool"),
    ("log", "log_interval", 0, "log.log_interval=0: must be >= 1"),
    ("log", "sample_interval", -1, "log.sample_interval=-1: must be >= 0 (0: only a final grid)"),
    ("diffusion", "objective", "flwo", "diffusion.objective='flwo': use one of ['ddpm', 'edm', 'flow']; did you mean 'flow'?"),
    ("diffusion", "sample_steps", 0, "diffusion.sample_steps=0: must be >= 1"),
    ("diffusion", "ddpm_variance", "learned", "diffusion.ddpm_variance='learned': use 'learned_range' or 'fixed_small'"),
    ("model", "preset", "DiT-XL/3", "model.preset='DiT-XL/3': unknown preset"),
    ("model", "family", "ditt", "did you mean 'dit'?"),
    ("model", "backend", "tee", "did you mean 'te'?"),
    ("model", "class_dropout_prob", 1.0, "model.class_dropout_prob=1.0: must be in [0, 1)"),
    ("model", "num_layers", 0, "model.num_layers=0: must be >= 1"),
    ("model", "moe_router_topk", 2, "model.moe_router_topk=2: must be in [1, model.num_moe_experts=None]"),
    ("model", "num_attention_heads", 3, "set model.num_attention_heads=2 or model.hidden_size=36"),
    ("model", "fp8", "fp16", "model.fp8='fp16': use one of torchao's recipes ('tensorwise', 'rowwise', 'rowwise_with_gw_hp')"),
    ("model", "attention_backend", "cudnn", "model.attention_backend='cudnn': use one of"),
    ("model", "compile_mode", "max-autotune-no-cudagraphs",
     "model.compile_mode='max-autotune-no-cudagraphs': takes effect only with model.compile=True"),
    ("model", "compile_options", {"triton.multi_kernel": 1},
     "model.compile_options={'triton.multi_kernel': 1}: takes effect only with model.compile=True"),
    ("optim", "adam_impl", "fusd", "optim.adam_impl='fusd': use one of ('auto', 'flat', 'fused', 'foreach', 'megatron'); did you mean 'fused'?"),
    ("optim", "exp_avg_dtype", "fp16", "optim.exp_avg_dtype='fp16': use one of ('fp32', 'bf16')"),
    ("optim", "main_grads_dtype", "fp16", "optim.main_grads_dtype='fp16': use one of ('fp32', 'bf16')"),
    ("optim", "main_grads_dtype", "bf16", "optim.main_grads_dtype='bf16' needs trainer.bf16=True"),
    ("data", "global_batch_size", 0, "data.global_batch_size=0: must be >= 1"),
    ("data", "global_batch_size", 12, "data.global_batch_size (12) must be a multiple of data.micro_batch_size"),
    ("data", "micro_batch_size", 0, "data.micro_batch_size=0: must be >= 1"),
    ("data", "num_workers", -1, "data.num_workers=-1: must be >= 0"),
    ("data", "max_seq_len", 0, "data.max_seq_len=0: must be >= 1"),
    ("data", "blend_mode", "weights", "data.blend_mode='weights': must be one of ('weight', 'epoch')"),
    ("data", "image_size", 16, "model.input_size=8 but data.name=digits has 16: set model.input_size=16"),
    ("data", "path", "/", "data.path='/' is not a prepared energon dataset (no .nv-meta/ inside)"),
    ("data", "path", "/no/such/dir", "data.path='/no/such/dir' does not exist"),
    ("parallel", "tensor_model_parallel_size", 4, "world size"),
    ("parallel", "sequence_parallel", True, "parallel.sequence_parallel=True needs parallel.tensor_model_parallel_size > 1"),
]


@pytest.mark.parametrize("section, field, value, expected", BAD, ids=[f"{s}.{f}={v}" for s, f, v, _ in BAD])
def test_bad_config_fails_before_compute_naming_the_field(tmp_path, section, field, value, expected):
    cfg = tiny_run(tmp_path)
    setattr(getattr(cfg, section), field, value)
    problems = run_problems(cfg, world_size=1)
    assert len(problems) == 1 and expected in problems[0], problems
    assert "\n" not in problems[0]


def test_the_suggested_fix_passes_every_check():
    with pytest.raises(ConfigError, match="set model.num_attention_heads=2 or model.hidden_size=72"):
        preset("tiny", num_attention_heads=3)
    for fix in (dict(num_attention_heads=2), dict(num_attention_heads=3, hidden_size=72)):
        preset("tiny", **fix)
    # Under tensor parallelism every suggested head count must split over the TP ranks.
    with pytest.raises(ConfigError, match=r"set model.num_attention_heads=4$"):
        preset("tiny", hidden_size=32, num_attention_heads=3, tensor_model_parallel_size=4)
    with pytest.raises(ConfigError, match="set model.num_attention_heads=4 with model.hidden_size=32$"):
        preset("tiny", hidden_size=30, num_attention_heads=3, tensor_model_parallel_size=2)
    for fix in (dict(hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=4),
                dict(hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=2)):
        preset("tiny", **fix)


def test_all_problems_are_reported_at_once_and_nothing_is_written(tmp_path):
    cfg = tiny_run(tmp_path / "run")
    cfg.optim.lr, cfg.trainer.ema_decay, cfg.log.log_interval = -1.0, 2.0, 0
    with pytest.raises(ConfigError) as err:
        Trainer(cfg)
    lines = str(err.value).splitlines()
    assert lines[0] == "3 config problems:" and len(lines) == 4
    assert not (tmp_path / "run").exists()


def test_a_good_config_has_no_problems(tmp_path):
    validate_run(tiny_run(tmp_path), world_size=1)


@pytest.mark.parametrize("arg, expected", [
    ("trainer.max_step=5", "TrainerConfig has no field 'max_step'; did you mean 'max_steps'?"),
    ("trainr.max_steps=5", "unknown config section 'trainr'; did you mean 'trainer'?"),
    ("optim.learning_rate=1", "OptimConfig has no field 'learning_rate'"),
    ("trainer.max_steps=5", None),
    ("run.executor=local", None),
    ("--yes", None),
])
def test_override_names_are_checked_with_a_did_you_mean(arg, expected):
    from dit_mcore.recipes.entry import train
    problem = override_problem(arg, config_sections(train))
    assert (problem is None) if expected is None else (expected in problem), problem


def test_layernorm_recompute_with_compile_is_refused_before_compute(tmp_path):
    cfg = tiny_run(tmp_path)
    cfg.model.recompute_granularity, cfg.model.recompute_modules, cfg.model.compile = "selective", ["layernorm"], True
    problems = run_problems(cfg, world_size=1)
    assert len(problems) == 1 and "does not trace under model.compile=True" in problems[0], problems
    cfg.model.compile = False
    assert run_problems(cfg, world_size=1) == []


def test_core_attention_recompute_with_compile_is_refused_and_mlp_recompute_is_not(tmp_path):
    cfg = tiny_run(tmp_path)
    cfg.model.recompute_granularity, cfg.model.recompute_modules, cfg.model.compile = "selective", ["core_attn", "mlp"], True
    problems = run_problems(cfg, world_size=1)
    assert len(problems) == 1 and "model.recompute_modules" in problems[0] and "drop 'core_attn'" in problems[0], problems
    cfg.model.recompute_modules = ["mlp"]
    assert run_problems(cfg, world_size=1) == []
    cfg.model.recompute_modules = None  # megatron's default: ["core_attn"]
    assert len(run_problems(cfg, world_size=1)) == 1
    cfg.model.recompute_modules, cfg.model.compile = ["core_attn", "mlp"], False
    assert run_problems(cfg, world_size=1) == []


def test_ema_offload_under_fsdp_is_refused_before_compute(tmp_path):
    cfg = tiny_run(tmp_path)
    cfg.trainer.ema_offload, cfg.parallel.fsdp = True, "torch"
    problems = run_problems(cfg, world_size=1)
    assert len(problems) == 1 and "FSDP shards the EMA shadow" in problems[0], problems
    cfg.parallel.fsdp = "none"
    assert run_problems(cfg, world_size=1) == []


def test_a_sharded_ema_without_the_distributed_optimizer_is_refused_before_compute(tmp_path):
    cfg = tiny_run(tmp_path)
    cfg.trainer.ema_shard = True
    problems = run_problems(cfg, world_size=2)
    assert len(problems) == 1 and "needs optim.use_distributed_optimizer=True" in problems[0], problems
    cfg.optim.use_distributed_optimizer = True
    assert run_problems(cfg, world_size=2) == []
    cfg.trainer.ema_offload = True  # the shards in host memory
    assert run_problems(cfg, world_size=2) == []


def test_an_unknown_compile_mode_is_refused_before_compute(tmp_path):
    cfg = tiny_run(tmp_path)
    cfg.model.compile, cfg.model.compile_mode = True, "reduce-overhead"
    problems = run_problems(cfg, world_size=1)
    assert len(problems) == 1 and "model.compile_mode='reduce-overhead': use one of" in problems[0], problems


@pytest.mark.parametrize("options, expected", [
    ({"triton.multi_kernal": 1}, "'triton.multi_kernal' is not an Inductor option; did you mean 'triton.multi_kernel'?"),
    ({"triton.cudagraphs": True}, "'triton.cudagraphs': CUDA graphs are not offered"),
    ({"coordinate_descent_tuning": 1}, "'coordinate_descent_tuning' must be of type bool"),
    ("triton.multi_kernel=1", "model.compile_options='triton.multi_kernel=1': must be of type Optional[dict]"),
])
def test_bad_compile_options_are_refused_before_compute(tmp_path, options, expected):
    cfg = tiny_run(tmp_path)
    cfg.model.compile, cfg.model.compile_options = True, options
    problems = run_problems(cfg, world_size=1)
    assert len(problems) == 1 and expected in problems[0], problems
    cfg.model.compile_options = {"triton.multi_kernel": 1, "coordinate_descent_tuning": True,
                                 "triton.cudagraphs": False, "triton.cudagraph_trees": True}
    assert run_problems(cfg, world_size=1) == []


def test_bf16_gradient_buffers_under_fsdp_are_refused_before_compute(tmp_path):
    cfg = tiny_run(tmp_path)
    cfg.trainer.bf16, cfg.optim.main_grads_dtype, cfg.parallel.fsdp = True, "bf16", "megatron"
    problems = run_problems(cfg, world_size=1)
    assert len(problems) == 1 and "optim.main_grads_dtype='bf16' with parallel.fsdp='megatron'" in problems[0] \
        and "set optim.main_grads_dtype=fp32" in problems[0], problems
    cfg.parallel.fsdp = "none"
    assert run_problems(cfg, world_size=1) == []


def test_bf16_moments_outside_the_flat_adamw_are_refused_before_compute(tmp_path, monkeypatch):
    cfg = tiny_run(tmp_path)
    cfg.optim.exp_avg_sq_dtype, cfg.optim.adam_impl = "bf16", "fused"
    problems = run_problems(cfg, world_size=1)
    assert len(problems) == 1 and "optim.exp_avg_sq_dtype='bf16'" in problems[0] \
        and "set optim.adam_impl=flat" in problems[0], problems
    cfg.optim.adam_impl, cfg.parallel.fsdp = "auto", "torch"
    problems = run_problems(cfg, world_size=1)
    assert len(problems) == 1 and "FSDP steps torch's AdamW" in problems[0], problems
    cfg.parallel.fsdp = "none"
    assert run_problems(cfg, world_size=1) == []
    cfg.optim.adam_impl = "megatron"  # megatron's own pick: TE's or apex's FusedAdam where installed
    problems = run_problems(cfg, world_size=1)
    assert len(problems) == 1 and "not optim.adam_impl='megatron'" in problems[0], problems
