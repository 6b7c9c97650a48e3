"""Transformer Engine's FP8 (``model.fp8`` with ``model.backend=te``): the recipe reaches megatron's
``fp8`` / ``fp8_recipe`` fields, the layer stack enters megatron's FP8 context as its
``TransformerBlock`` does (delayed scaling around the stage, other recipes per layer by global index,
TE's checkpoint for full recompute), the EMA shadow is built without it, and every setting TE's FP8
cannot run fails before compute. Neither this machine nor the lent GPUs have TE: its linears,
megatron's context and TE's checkpoint are stood in (the local linears, a recording context,
megatron's own checkpoint), so the training itself is bf16's -- the test is of the wiring."""
import contextlib

import pytest
import torch
from packaging.version import Version
from megatron.core import fp8_utils, parallel_state, tensor_parallel
from megatron.core.extensions import transformer_engine as megatron_te

from dit_mcore.errors import ConfigError
from dit_mcore.models import specs, te_fp8
from dit_mcore.models.aten_linear import AtenColumnParallelLinear, AtenRowParallelLinear
from dit_mcore.models.dit.model import build_model
from dit_mcore.training.config import ModelConfig
from dit_mcore.training.trainer import Trainer
from dit_mcore.training.validate import run_problems
from dit_mcore.parallel.config import ParallelConfig
from test_parallel_layouts import _randomize
from test_training import tiny_run


def test_te_recipes_reach_megatrons_fp8_fields_and_torchaos_stay_apart():
    te = ModelConfig(preset="digits", backend="te", fp8="delayed", fp8_amax_history_len=16,
                     fp8_amax_compute_algo="max").build(ParallelConfig())
    assert (te.fp8, te.fp8_recipe, te.float8_recipe) == ("hybrid", "delayed", None)
    assert (te.fp8_amax_history_len, te.fp8_amax_compute_algo) == (16, "max")
    e4m3 = ModelConfig(preset="digits", backend="te", fp8="tensorwise", fp8_format="e4m3").build(ParallelConfig())
    assert (e4m3.fp8, e4m3.fp8_recipe) == ("e4m3", "tensorwise")
    torchao = ModelConfig(preset="digits", backend="auto", fp8="tensorwise").build(ParallelConfig())
    assert (torchao.fp8, torchao.float8_recipe) == (None, "tensorwise")


def test_te_fp8_layers_need_te_linears_never_the_local_fallback():
    config = ModelConfig(preset="digits", num_layers=1, backend="te", fp8="tensorwise").build(ParallelConfig())
    with pytest.raises(ValueError, match="needs TE's linears, which do not load here"):
        build_model(config, backend="te")  # no TE on this machine
    with pytest.raises(ValueError, match="runs in TE's linears: use backend='te', not 'local'"):
        build_model(config, backend="local")


class _StandInTE:
    """A local linear standing in for TE's: it keeps TE's ``is_first_microbatch`` flag (megatron's
    schedule sets it at each step's first micro-batch through ``set_is_first_microbatch``; TE then
    re-casts the weight to FP8 and caches it for the step's other micro-batches) and records it."""

    is_first_microbatch = None
    seen: list = []

    def forward(self, *args, **kwargs):
        self.seen.append(self.is_first_microbatch)
        self.is_first_microbatch = False  # (what TE's linears do after each forward)
        return super().forward(*args, **kwargs)


class StandInTEColumn(_StandInTE, AtenColumnParallelLinear):
    pass


class StandInTERow(_StandInTE, AtenRowParallelLinear):
    pass


@pytest.fixture
def te_stand_ins(monkeypatch):
    """TE's linears -> recording local ones, megatron's FP8 context -> a recorder of the layer indices
    it is entered for (-1: the whole stage), TE's checkpoint -> megatron's (counted); TE counts as
    installed (its GPU and version checks are tested below)."""
    calls = {"contexts": [], "te_checkpoints": 0, "first_microbatch": []}

    @contextlib.contextmanager
    def context(config, layer_no=-1, is_init=False):
        assert config.fp8 == "hybrid" and not is_init
        calls["contexts"].append(layer_no)
        yield

    def te_checkpoint(function, distribute_saved_activations, get_rng_state_tracker, tp_group, *args):
        assert get_rng_state_tracker is tensor_parallel.random.get_cuda_rng_tracker and tp_group is not None
        calls["te_checkpoints"] += 1
        return tensor_parallel.checkpoint(function, distribute_saved_activations, *args)

    monkeypatch.setattr(_StandInTE, "seen", calls["first_microbatch"])
    monkeypatch.setattr(specs, "te_linears", lambda: (StandInTEColumn, StandInTERow))
    monkeypatch.setattr(fp8_utils, "get_fp8_context", context)
    monkeypatch.setattr(megatron_te, "te_checkpoint", te_checkpoint)
    monkeypatch.setattr(specs, "te_installed", lambda: True)
    for check in ("check_machine", "check_layout"):  # (its GPU, version and alignment checks: below)
        monkeypatch.setattr(te_fp8, check, lambda *a: None)
    return calls


def _losses(run_dir, steps, **model):
    cfg = tiny_run(run_dir, max_steps=steps)  # 2 layers, 2 micro-batches of 8 per step
    cfg.model.backend = "te"
    for field, value in model.items():
        setattr(cfg.model, field, value)
    trainer = Trainer(cfg)
    _randomize(trainer)
    assert (trainer.ema.module.config.fp8, trainer.ema.module.config.float8_recipe) == (None, None)
    config = trainer.model[0].config
    # The group megatron's real context reduces amaxes over (TE's fp8_group) exists in this world.
    assert parallel_state.get_amax_reduction_group(with_context_parallel=True,
                                                   tp_only_amax_red=config.tp_only_amax_red) is not None
    return [h["loss"] for h in trainer.fit()], config


FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2}


@pytest.mark.parametrize("recipe, recompute, per_forward, checkpoints_per_forward", [
    ("tensorwise", {}, [0, 1], 0),  # per layer, by global index
    ("delayed", {}, [-1], 0),  # around the stage: one amax reduction per forward
    ("tensorwise", FULL, [0, 1, 0, 1], 1),  # the recomputation in backward enters them again
    ("delayed", dict(FULL, recompute_method="block", recompute_num_layers=1), [-1], 1),
    # (TE's checkpoint restores the forward's FP8 state for the recomputation itself)
    ("tensorwise", {"recompute_granularity": "selective", "recompute_modules": ["mlp"]}, [0, 1], 2),  # each MLP
])
def test_the_layer_stack_enters_megatrons_fp8_context_as_its_transformer_block_does(
        tmp_path, te_stand_ins, recipe, recompute, per_forward, checkpoints_per_forward):
    steps, micro_batches, linears = 2, 2, 2 * 4  # (2 layers of qkv, proj, fc1, fc2)
    plain, _ = _losses(tmp_path / "plain", steps, **recompute)
    assert te_stand_ins["contexts"] == [] and te_stand_ins["te_checkpoints"] == 0
    te_stand_ins["first_microbatch"].clear()
    fp8, config = _losses(tmp_path / "fp8", steps, fp8=recipe, **recompute)
    assert (config.fp8, config.fp8_recipe) == ("hybrid", recipe)
    assert te_stand_ins["contexts"] == per_forward * steps * micro_batches
    assert te_stand_ins["te_checkpoints"] == checkpoints_per_forward * steps * micro_batches
    # megatron's schedule tells TE's linears each step's first micro-batch (their FP8 weight cache).
    seen = te_stand_ins["first_microbatch"]
    assert seen.count(True) == steps * linears and seen[:linears] == [True] * linears, seen
    # megatron with config.fp8 set changes nothing else: the same losses as without it (the context
    # stands in, so a difference could only come from megatron or the project reading config.fp8).
    assert fp8 == plain


def test_the_text_key_value_projection_stays_a_bf16_local_linear(te_stand_ins):
    """Its rows are the batch's text tokens, of any count; TE's FP8 GEMMs need multiples of 16."""
    from dit_mcore.models.dit.spec import dit_layer_spec
    layer = dit_layer_spec("te", cross_attention=True, te_fp8=True).submodules
    cross, attention = layer.cross_attention.submodules, layer.self_attention.submodules
    assert cross.linear_kv is AtenColumnParallelLinear
    assert (cross.linear_q, cross.linear_proj, attention.linear_qkv) == (StandInTEColumn, StandInTERow, StandInTEColumn)
    assert dit_layer_spec("te", cross_attention=True).submodules.cross_attention.submodules.linear_kv is StandInTEColumn


@pytest.mark.parametrize("changes, field, expected", [
    ({"backend": "te", "fp8": "rowwise"}, "model.fp8", "torchao's recipes need model.backend=auto or local"),
    ({"fp8": "delayed"}, "model.fp8", "Transformer Engine's recipes need model.backend=te"),
    ({"fp8": "tensorwise", "fp8_format": "e4m3"}, "model.fp8_format", "only with model.fp8 and model.backend=te"),
    ({"backend": "te", "fp8": "tensorwise", "fp8_format": "e5m2"}, "model.fp8_format", "use one of ('hybrid', 'e4m3')"),
    ({"backend": "te", "fp8": "tensorwise", "fp8_amax_history_len": 16}, "model.fp8_amax_history_len",
     "only with model.fp8=delayed"),
    ({"backend": "te", "fp8": "delayed", "compile": True}, "model.compile", "TE's modules under torch.compile"),
    ({"backend": "te", "fp8": "tensorwise", "recompute_granularity": "selective", "recompute_modules": ["layernorm"]},
     "model.recompute_modules", "the linear keeps its own quantized copy"),
])
def test_bad_te_fp8_settings_name_the_field(tmp_path, monkeypatch, changes, field, expected):
    monkeypatch.setattr(specs, "te_installed", lambda: True)
    cfg = tiny_run(tmp_path)
    for name, value in changes.items():
        setattr(cfg.model, name, value)
    problems = run_problems(cfg, world_size=1)
    assert len(problems) == 1 and problems[0].startswith(field) and expected in problems[0], problems


@pytest.mark.parametrize("moe", [False, True])
def test_te_without_te_is_one_named_problem_before_the_model_config_is_built(tmp_path, moe):
    """(megatron's config itself asks TE's version for an MoE under FP8, and fails without TE.)"""
    cfg = tiny_run(tmp_path)
    cfg.model.backend, cfg.model.fp8 = "te", "tensorwise"
    if moe:
        cfg.model.num_moe_experts, cfg.model.moe_router_topk = 4, 2
    problems = run_problems(cfg, world_size=1)
    assert len(problems) == 1 and problems[0].startswith("model.backend='te'"), problems
    assert "Transformer Engine is not installed here" in problems[0]


def test_te_linears_are_taken_only_when_asked_for(monkeypatch):
    """``auto`` is the local path (the measured one) also where TE is installed; ``te`` takes TE's."""
    monkeypatch.setattr(specs, "te_linears", lambda: (StandInTEColumn, StandInTERow))
    assert specs.linears("auto") == specs.linears("local") == (AtenColumnParallelLinear, AtenRowParallelLinear)
    assert specs.linears("te") == (StandInTEColumn, StandInTERow)


def test_te_refuses_the_meta_device_build(tmp_path, monkeypatch):
    monkeypatch.setattr(specs, "te_installed", lambda: True)
    cfg = tiny_run(tmp_path)
    cfg.model.backend, cfg.model.init_model_with_meta_device = "te", True
    problems = run_problems(cfg, world_size=1)
    assert len(problems) == 1 and problems[0].startswith("model.init_model_with_meta_device"), problems


def _fp8_gpu(monkeypatch, capability=(9, 0), te_version="2.8.0"):
    """This process as one on a GPU of ``capability`` with TE ``te_version`` (TE's presence is a field rule)."""
    from megatron.core import utils
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: {(8, 0): "NVIDIA A100", (9, 0): "NVIDIA H100"}[capability])
    monkeypatch.setattr(utils, "get_te_version", lambda: Version(te_version))


@pytest.mark.parametrize("machine, changes, expected", [
    ("cpu", {}, "needs a GPU with that recipe's FP8 tensor cores (Ada, Hopper or newer); this machine has no GPU"),
    ("a100", {}, "(Ada, Hopper or newer); this machine has NVIDIA A100"),
    ("h100", {"fp8": "mxfp8"}, "(Blackwell or newer); this machine has NVIDIA H100"),
    ("h100 te2.1", {}, "needs Transformer Engine >= 2.2.0.dev0; this machine has 2.1.0"),
    ("h100 te2.1", {"fp8": "delayed"}, None),  # (megatron asks no version of delayed scaling)
    ("h100", {"bf16": False}, "set trainer.bf16=True"),
    ("h100", {"hidden_size": 40, "num_attention_heads": 2}, "divisible by 16, but hidden_size = 40"),
    ("h100", {"fp8": "blockwise", "micro_batch_size": 1}, None),  # 16 rows
    ("h100", {"tp_sp": 2, "micro_batch_size": 1},  # each rank quantizes its 8 rows before SP's all-gather
     "a micro-batch of 1 x 16 tokens over 2 ranks (context_parallel_size x tensor_model_parallel_size under "
     "sequence parallel) is not"),
    ("h100", {"tp_sp": 2}, None),  # 8 x 16 rows over 2
    ("h100", {"fp8": "blockwise", "micro_batch_size": 1, "tp_sp": 2, "video_frames": 4}, None),  # 64 rows over 2
    ("h100", {"mock_latent_shapes": [[1, 8, 8], [1, 4, 4]], "max_seq_len": 72, "micro_batch_size": 1},
     "1 pack(s) of data.max_seq_len=72 tokens over one rank are not; set data.max_seq_len to a multiple of 16"),
    ("h100", {"mock_latent_shapes": [[1, 8, 8], [1, 4, 4]], "max_seq_len": 48, "micro_batch_size": 1, "tp_sp": 2},
     "set data.max_seq_len to a multiple of 32"),
    ("h100", {"mock_latent_shapes": [[1, 8, 8], [1, 4, 4]], "max_seq_len": 64, "micro_batch_size": 1, "tp_sp": 2}, None),
    ("h100", {"energon": False, "pad_multiple": 8}, "unpacked samples come in any length; set data.pad_multiple to a "
                                                    "multiple of 16"),
    ("h100", {"energon": False, "pad_multiple": 32, "tp_sp": 2}, None),
    ("h100", {"family": "stdit", "preset": "stdit-tiny", "cp": 2}, "the ST-DiT's frame/position switch under context"),
    ("h100", {}, None),
])
def test_te_fp8_needs_its_recipes_gpu_and_te_bf16_and_aligned_tokens(tmp_path, monkeypatch, machine, changes, expected):
    if machine != "cpu":
        _fp8_gpu(monkeypatch, capability=(8, 0) if machine == "a100" else (9, 0),
                 te_version="2.1.0" if "te2.1" in machine else "2.8.0")
    cfg = tiny_run(tmp_path)  # dense 8 x 16 tokens per micro-batch, hidden 32
    cfg.model.backend, cfg.model.fp8, cfg.trainer.bf16 = "te", changes.pop("fp8", "tensorwise"), changes.pop("bf16", True)
    world_size = 1
    for name, value in changes.items():
        if name == "cp":
            cfg.parallel.context_parallel_size, world_size = value, value
        elif name == "tp_sp":
            cfg.parallel.tensor_model_parallel_size, cfg.parallel.sequence_parallel, world_size = value, True, value
        elif name == "mock_latent_shapes":
            cfg.data.name, cfg.data.mock_latent_shapes = "mock", value
        elif name == "video_frames":  # dense moving-digit videos (frames are tokens too)
            cfg.data.name, cfg.data.video_frames = "moving_digits", value  # (patch_size_t 1)
        elif name == "energon":  # a prepared dataset, packed or not
            cfg.data.path, cfg.data.packing = str(tmp_path / "prepared"), value
        elif name in ("micro_batch_size", "pad_multiple", "max_seq_len"):
            setattr(cfg.data, name, value)
        else:
            setattr(cfg.model, name, value)
    model = cfg.model.build(ParallelConfig())
    if expected is None:
        te_fp8.check_run(cfg, model, world_size=world_size)
        return
    with pytest.raises(ConfigError, match="model.fp8=") as error:
        te_fp8.check_run(cfg, model, world_size=world_size)
    assert expected in str(error.value), error.value
