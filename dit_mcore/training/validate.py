"""The whole run config checked in one place, before any process group, model or data exists.

Every problem is one line naming ``section.field``, the value, the rule and the fix; all problems
are reported together (a :class:`ConfigError`, which the launcher prints without a traceback).
Field types come from the dataclass annotations; value rules of the data section live with
``DataConfig`` (usable without the trainer), those of the parallel layout in
``dit_mcore.parallel.layout``; this module runs them all, plus the cross-section rules.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from dit_mcore.errors import ConfigError
from dit_mcore.training import data_fit
from dit_mcore.training.optim import RESUME_SCHEDULES, STATE_DTYPES, moments_below_fp32
from dit_mcore.diffusion.registry import OBJECTIVES
from dit_mcore.models.float8 import RECIPES as FLOAT8_RECIPES
from dit_mcore.models import specs, te_fp8
from dit_mcore.models.te_fp8 import FORMATS as TE_FP8_FORMATS, RECIPES as TE_FP8_RECIPES
from dit_mcore.models.layer_stack import COMPILE_MODES
from dit_mcore.models.registry import families, get_family
from dit_mcore.parallel.config import ParallelConfig
from dit_mcore.training.profiling import parse_steps
from dit_mcore.training.weights import WEIGHTS
from dit_mcore.parallel import tp_comm_overlap
from dit_mcore.parallel.layout import check_layout
from dit_mcore.kernels.attention_kernels import BACKENDS as ATTENTION_BACKENDS

BACKENDS = ("auto", "local", "te")
DECAY_STYLES = ("cosine", "linear", "constant")
ADAM_IMPLS = ("auto", "flat", "fused", "foreach", "megatron")


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (list, tuple):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return isinstance(value, (list, tuple)) and all(_type_ok(v, args[0]) for v in value) if args \
            else isinstance(value, (list, tuple))
    if origin is dict:  # data.blend is normalised to (path, weight) pairs
        return isinstance(value, (dict, list))
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return f"one of {typing.get_args(hint)}"
    name = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
    return f"of type {name}"


def type_problems(section: str, obj: Any) -> list[str]:
    hints = typing.get_type_hints(type(obj))
    return [f"{section}.{f.name}={getattr(obj, f.name)!r}: must be {_type_name(hints[f.name])}"
            for f in dataclasses.fields(obj) if f.name in hints and not _type_ok(getattr(obj, f.name), hints[f.name])]


class _Rules:
    """Collects one-line problems: ``need(ok, "section.field", value, "rule; fix")``."""

    def __init__(self):
        self.problems: list[str] = []

    def need(self, ok: bool, field: str, value: Any, rule: str) -> None:
        if not ok:
            self.problems.append(f"{field}={value!r}: {rule}")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _compile_option_rules(r: _Rules, options: dict) -> None:
    """Inductor options must exist (``torch._inductor.list_options()``) and have the type torch.compile
    checks (it would refuse them only when the first layer compiles), and CUDA graphs are not offered
    (as for the compile modes: untested with megatron's gradient hooks)."""
    import torch._inductor
    import torch._inductor.config as inductor_config

    known = torch._inductor.list_options()
    for name, value in options.items():
        if name not in known:
            r.need(False, "model.compile_options", options,
                   f"{name!r} is not an Inductor option{did_you_mean(str(name), known)}")
            continue
        kind = inductor_config.get_type(name)
        r.need(typing.get_origin(kind) is not None or isinstance(value, kind), "model.compile_options", options,
               f"{name!r} must be of type {getattr(kind, '__name__', kind)}")
        r.need(not (name == "triton.cudagraphs" and value), "model.compile_options", options,
               f"{name!r}: CUDA graphs are not offered (untested with megatron's gradient hooks)")


def _model_rules(r: _Rules, m) -> None:
    r.need(m.family in families(), "model.family", m.family,
           f"unknown family; use one of {families()}{did_you_mean(m.family, families())}")
    presets = get_family(m.family).presets() if m.family in families() else {}
    r.need(not presets or m.preset in presets, "model.preset", m.preset,
           f"unknown preset of model.family={m.family}; use one of {sorted(presets)}{did_you_mean(m.preset, presets)}")
    r.need(m.text_dropout_prob is None or 0.0 <= m.text_dropout_prob < 1.0, "model.text_dropout_prob",
           m.text_dropout_prob, "must be in [0, 1) (the text-dropout probability for CFG)")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "patch_size", "input_size", "in_channels"):
        value = getattr(m, name)
        r.need(value is None or value >= 1, f"model.{name}", value, "must be >= 1 (or unset: the preset's value)")
    r.need(m.num_classes is None or m.num_classes >= 0, "model.num_classes", m.num_classes,
           "must be >= 0 (0: unconditional)")
    r.need(m.class_dropout_prob is None or 0.0 <= m.class_dropout_prob < 1.0, "model.class_dropout_prob",
           m.class_dropout_prob, "must be in [0, 1) (the label-dropout probability for CFG)")
    r.need(m.backend in BACKENDS, "model.backend", m.backend, f"use one of {BACKENDS}{did_you_mean(m.backend, BACKENDS)}")
    r.need(m.backend != "te" or specs.te_installed(), "model.backend", m.backend,
           "Transformer Engine is not installed here: use the NGC PyTorch image (the project's Dockerfile), or set "
           "model.backend=auto (megatron's local linears; model.fp8 then runs torchao's recipes)")
    r.need(not (m.backend == "te" and m.init_model_with_meta_device), "model.init_model_with_meta_device",
           m.init_model_with_meta_device, "with model.backend=te: the meta-device build initialises on the CPU "
           "(use_cpu_initialization), where megatron's TE linears copy from a meta tensor and fail; set it to False "
           "or use model.backend=auto")
    norm_recompute = m.recompute_granularity == "selective" and "layernorm" in (m.recompute_modules or ())
    r.need(not (norm_recompute and m.compile), "model.recompute_modules", m.recompute_modules,
           "'layernorm' recompute (megatron's CheckpointWithoutOutput) does not trace under model.compile=True; "
           "drop 'layernorm' or set model.compile=False")
    attention_recompute = m.recompute_granularity == "selective" and "core_attn" in (
        m.recompute_modules if m.recompute_modules is not None else ["core_attn"])  # (megatron's default)
    r.need(not (attention_recompute and m.compile), "model.recompute_modules", m.recompute_modules,
           "'core_attn' recompute (megatron's checkpointed core attention: its RNG-state save and .item() do not "
           "trace) breaks each compiled layer into pieces under model.compile=True, and the fused attention "
           "kernels keep no score matrix for it to free; drop 'core_attn' (recompute 'mlp') or set "
           "model.compile=False")
    r.need(m.compile_mode is None or m.compile_mode in COMPILE_MODES, "model.compile_mode", m.compile_mode,
           f"use one of {COMPILE_MODES}{did_you_mean(str(m.compile_mode), COMPILE_MODES)} or None (default)")
    r.need(m.compile_mode is None or m.compile, "model.compile_mode", m.compile_mode,
           "takes effect only with model.compile=True: set it, or leave compile_mode unset")
    r.need(m.compile_options is None or m.compile, "model.compile_options", m.compile_options,
           "takes effect only with model.compile=True: set it, or leave compile_options unset")
    if isinstance(m.compile_options, dict):  # (its type is checked with every field's)
        _compile_option_rules(r, m.compile_options)
    r.need(m.attention_backend is None or m.attention_backend in ATTENTION_BACKENDS, "model.attention_backend",
           m.attention_backend,
           f"use one of {ATTENTION_BACKENDS}{did_you_mean(str(m.attention_backend), ATTENTION_BACKENDS)} or None (auto)")
    _fp8_rules(r, m)
    r.need(m.num_moe_experts is None or m.num_moe_experts >= 1, "model.num_moe_experts", m.num_moe_experts,
           "must be >= 1, or unset for a dense MLP")
    if m.moe_router_topk is not None:
        experts = m.num_moe_experts or 0
        r.need(1 <= m.moe_router_topk <= max(experts, 1), "model.moe_router_topk", m.moe_router_topk,
               f"must be in [1, model.num_moe_experts={m.num_moe_experts}]; lower it or add experts")
    r.need(m.moe_aux_loss_coeff is None or (_finite(m.moe_aux_loss_coeff) and m.moe_aux_loss_coeff >= 0),
           "model.moe_aux_loss_coeff", m.moe_aux_loss_coeff, "must be >= 0")
    r.need(m.chunk_tokens is None or (isinstance(m.chunk_tokens, int) and m.chunk_tokens >= 1), "model.chunk_tokens",
           m.chunk_tokens, "must be a positive number of tokens, or None (off)")
    r.need(not (m.chunk_tokens and m.num_moe_experts), "model.chunk_tokens", m.chunk_tokens,
           "does not combine with MoE layers (their load-balancing loss is over the whole sequence); unset one")


def _fp8_rules(r: _Rules, m) -> None:
    """``model.fp8``: torchao's recipes on the local linears, Transformer Engine's with ``backend=te``."""
    te = m.backend == "te"
    recipes, which = (TE_FP8_RECIPES, "Transformer Engine's") if te else (FLOAT8_RECIPES, "torchao's")
    hint = ("; torchao's recipes need model.backend=auto or local" if te and m.fp8 in FLOAT8_RECIPES else
            "; Transformer Engine's recipes need model.backend=te" if not te and m.fp8 in TE_FP8_RECIPES else
            did_you_mean(str(m.fp8), recipes))
    r.need(m.fp8 is None or m.fp8 in recipes, "model.fp8", m.fp8,
           f"use one of {which} recipes {recipes} or None (off){hint}")
    r.need(m.fp8_format is None or (te and m.fp8 is not None), "model.fp8_format", m.fp8_format,
           "sets Transformer Engine's FP8 format: only with model.fp8 and model.backend=te; leave it unset")
    r.need(m.fp8_format is None or m.fp8_format in TE_FP8_FORMATS, "model.fp8_format", m.fp8_format,
           f"use one of {TE_FP8_FORMATS} or None (hybrid)")
    for name in ("fp8_amax_history_len", "fp8_amax_compute_algo"):
        r.need(getattr(m, name) is None or (te and m.fp8 == "delayed"), f"model.{name}", getattr(m, name),
               "tunes delayed scaling: only with model.fp8=delayed and model.backend=te; leave it unset")
    r.need(m.fp8_amax_history_len is None or m.fp8_amax_history_len >= 1, "model.fp8_amax_history_len",
           m.fp8_amax_history_len, "must be >= 1")
    r.need(m.fp8_amax_compute_algo in (None, "most_recent", "max"), "model.fp8_amax_compute_algo",
           m.fp8_amax_compute_algo, "use 'most_recent' or 'max'")
    if not (te and m.fp8 in TE_FP8_RECIPES):
        return
    r.need("layernorm" not in (m.recompute_modules or ()), "model.recompute_modules", m.recompute_modules,
           "'layernorm' recompute frees the modulated norm's output, but under Transformer Engine's FP8 the linear "
           "keeps its own quantized copy of it, so nothing is freed (megatron refuses it under delayed scaling and "
           "before TE 2.6); drop 'layernorm'")
    r.need(not m.compile, "model.compile", m.compile,
           "with Transformer Engine's FP8 (model.backend=te, model.fp8): TE's modules under torch.compile are "
           "untested here, and TE fuses its casts itself; set model.compile=False")


def _optim_rules(r: _Rules, o, max_steps: int) -> None:
    r.need(_finite(o.lr) and o.lr > 0, "optim.lr", o.lr, "must be a finite number > 0; e.g. optim.lr=1e-4")
    r.need(_finite(o.min_lr) and 0 <= o.min_lr and not (_finite(o.lr) and o.lr > 0 and o.min_lr > o.lr), "optim.min_lr",
           o.min_lr, f"must be in [0, optim.lr={o.lr}]")
    r.need(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    r.need(o.warmup_steps == 0 or max_steps < 1 or o.warmup_steps < max_steps, "optim.warmup_steps", o.warmup_steps,
           f"must be < trainer.max_steps={max_steps}; shorten the warmup or train longer")
    r.need(o.decay_style in DECAY_STYLES, "optim.decay_style", o.decay_style,
           f"use one of {DECAY_STYLES}{did_you_mean(o.decay_style, DECAY_STYLES)}")
    r.need(o.resume_schedule in RESUME_SCHEDULES, "optim.resume_schedule", o.resume_schedule,
           f"use one of {RESUME_SCHEDULES}{did_you_mean(o.resume_schedule, RESUME_SCHEDULES)}")
    r.need(o.adam_impl in ADAM_IMPLS, "optim.adam_impl", o.adam_impl,
           f"use one of {ADAM_IMPLS}{did_you_mean(o.adam_impl, ADAM_IMPLS)}")
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        value = getattr(o, name)
        r.need(value in STATE_DTYPES, f"optim.{name}", value, f"use one of {tuple(STATE_DTYPES)}")
        r.need(value == "fp32" or o.adam_impl in ("auto", "flat"), f"optim.{name}", value,
               f"moments below fp32 are kept only by the flat AdamW, not optim.adam_impl={o.adam_impl!r}; set "
               "optim.adam_impl=flat (or auto), or keep fp32")
    r.need(o.main_grads_dtype in STATE_DTYPES, "optim.main_grads_dtype", o.main_grads_dtype,
           f"use one of {tuple(STATE_DTYPES)}")
    r.need(_finite(o.weight_decay) and o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0")
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(o, name)
        r.need(_finite(value) and 0 <= value < 1, f"optim.{name}", value, "must be in [0, 1)")
    r.need(_finite(o.adam_eps) and o.adam_eps > 0, "optim.adam_eps", o.adam_eps, "must be > 0; e.g. 1e-8")
    r.need(_finite(o.clip_grad) and o.clip_grad >= 0, "optim.clip_grad", o.clip_grad, "must be >= 0 (0: no clipping)")


def check_cpu_offload(cfg) -> None:
    """``optim.cpu_offload``: megatron's HybridDeviceOptimizer, over megatron DDP's parameters, stepping torch's
    AdamW in fp32 moments."""
    o, why = cfg.optim, None
    if not (_finite(o.offload_fraction) and 0 < o.offload_fraction <= 1):
        why = f"needs optim.offload_fraction in (0, 1], not {o.offload_fraction}"
    elif cfg.parallel.fsdp != "none":
        why = f"is megatron DDP's, not parallel.fsdp={cfg.parallel.fsdp!r}'s; set parallel.fsdp=none"
    elif not o.use_distributed_optimizer:
        why = ("runs under megatron's distributed optimizer, as Megatron-LM requires (megatron 0.16's plain "
               "optimizer cannot load an offloaded state); set optim.use_distributed_optimizer=True")
    elif not cfg.trainer.bf16:
        why = ("offloads the distributed optimizer's fp32 copies of bf16 weights (in an fp32 run its shards are "
               "views of the weights, which megatron's offload cannot step); set trainer.bf16=True")
    elif o.adam_impl == "flat" or o.split_main_params or "bf16" in (o.exp_avg_dtype, o.exp_avg_sq_dtype,
                                                                        o.main_grads_dtype):
        why = ("steps megatron's sub-optimizers (torch's AdamW on the host and the device), not the flat AdamW: "
               "set optim.adam_impl=fused (or auto), fp32 moments and gradient buffers, no split main weights")
    if why:
        raise ConfigError(f"optim.cpu_offload=True {why}; or set optim.cpu_offload=False")


def _check_split_main_params(cfg) -> None:
    """``optim.split_main_params``: the flat AdamW's, over a bf16 model under megatron DDP."""
    o, why = cfg.optim, None
    if not cfg.trainer.bf16:
        why = "needs trainer.bf16=True (the main weights are split around their bf16 model weights)"
    elif o.adam_impl not in ("auto", "flat"):
        why = f"needs the flat AdamW, not optim.adam_impl={o.adam_impl!r}; set optim.adam_impl=flat (or auto)"
    elif cfg.parallel.fsdp != "none":
        why = (f"is not for parallel.fsdp={cfg.parallel.fsdp!r} (FSDP steps torch's AdamW over its own shards); "
               "set parallel.fsdp=none")
    if why:
        raise ConfigError(f"optim.split_main_params=True {why}; or set optim.split_main_params=False")


def _diffusion_rules(r: _Rules, d) -> None:
    r.need(d.objective in OBJECTIVES, "diffusion.objective", d.objective,
           f"use one of {sorted(OBJECTIVES)}{did_you_mean(d.objective, OBJECTIVES)}")
    r.need(d.ddpm_variance in ("learned_range", "fixed_small"), "diffusion.ddpm_variance", d.ddpm_variance,
           "use 'learned_range' or 'fixed_small'")
    r.need(d.sample_steps >= 1, "diffusion.sample_steps", d.sample_steps, "must be >= 1 (sampler steps of previews)")
    r.need(_finite(d.cfg_scale) and d.cfg_scale >= 0, "diffusion.cfg_scale", d.cfg_scale,
           "must be >= 0 (1: no guidance)")


def _trainer_rules(r: _Rules, t) -> None:
    r.need(t.max_steps >= 1, "trainer.max_steps", t.max_steps, "must be >= 1 (optimizer steps to train)")
    r.need(t.seed >= 0, "trainer.seed", t.seed, "must be >= 0")
    r.need(_finite(t.ema_decay) and 0 <= t.ema_decay < 1, "trainer.ema_decay", t.ema_decay,
           "must be in [0, 1); e.g. 0.9999")
    r.need(t.ema_every >= 1, "trainer.ema_every", t.ema_every,
           "must be >= 1 (optimizer steps between the EMA's passes over the weights; 1: every step)")
    r.need(t.save_interval >= 1, "trainer.save_interval", t.save_interval,
           "must be >= 1 (steps between checkpoints; a final one is always written)")
    r.need(t.keep_checkpoints >= 0, "trainer.keep_checkpoints", t.keep_checkpoints, "must be >= 0 (0: keep all)")
    r.need(t.peak_tflops is None or (_finite(t.peak_tflops) and t.peak_tflops > 0), "trainer.peak_tflops",
           t.peak_tflops, "must be a number > 0 (the device's dense peak) or None (look it up)")
    r.need(t.max_skipped_steps >= 1, "trainer.max_skipped_steps", t.max_skipped_steps,
           "must be >= 1 (non-finite steps in a row before the run stops)")
    r.need(t.val_interval >= 0, "trainer.val_interval", t.val_interval,
           "must be >= 0 (steps between validation losses; 0: none)")
    r.need(t.val_samples >= 1, "trainer.val_samples", t.val_samples, "must be >= 1 (validation samples)")
    r.need(t.val_levels >= 1, "trainer.val_levels", t.val_levels, "must be >= 1 (noise levels of the validation loss)")
    r.need(t.fid_interval >= 0, "trainer.fid_interval", t.fid_interval, "must be >= 0 (steps between FIDs; 0: none)")
    r.need(t.fid_samples >= 65, "trainer.fid_samples", t.fid_samples,
           "must be >= 65 (FID on the digits network's 64 features needs a full-rank covariance)")
    try:
        parse_steps(t.profile_steps)
    except ValueError as e:
        r.need(False, "trainer.profile_steps", t.profile_steps, str(e))
    for name, what in (("memory_snapshot", "records CUDA's caching allocator"),
                       ("flight_recorder", "records NCCL's collectives")):
        r.need(not getattr(t, name) or torch.cuda.is_available(), f"trainer.{name}", getattr(t, name),
               f"{what}; this machine has no GPU: unset it (trainer.profile_steps profiles on CPU too)")
    r.need(t.init_weights in WEIGHTS, "trainer.init_weights", t.init_weights,
           "must be 'ema' (the checkpoint's average) or 'model' (its trained weights)")


def _log_rules(r: _Rules, g) -> None:
    r.need(g.log_interval >= 1, "log.log_interval", g.log_interval, "must be >= 1 (steps between log lines)")
    r.need(g.sample_interval >= 0, "log.sample_interval", g.sample_interval, "must be >= 0 (0: only a final grid)")
    r.need(g.samples_per_class >= 1, "log.samples_per_class", g.samples_per_class, "must be >= 1")
    r.need(bool(g.dir), "log.dir", g.dir, "set a run directory")
    if g.wandb:
        import importlib.util
        r.need(importlib.util.find_spec("wandb") is not None, "log.wandb", g.wandb,
               "needs the wandb package: pip install wandb (or set log.wandb=False)")
        if importlib.util.find_spec("wandb") is not None:
            from dit_mcore.training.wandb_sink import credentials_problem
            problem = credentials_problem()
            r.need(not problem, "log.wandb", g.wandb, problem)


def model_problems(model) -> list[str]:
    """The problems of a ``ModelConfig`` alone (the rules that combine its fields, such as what compiles), one
    line each."""
    r = _Rules()
    _model_rules(r, model)
    return r.problems


def run_problems(cfg, world_size: int) -> list[str]:
    """Every problem of ``cfg`` (a ``RunConfig``) for ``world_size`` processes, one line each."""
    sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    problems = [p for name, section in sections.items() for p in type_problems(name, section)]
    if problems:  # value rules assume the types
        return problems
    r = _Rules()
    _model_rules(r, cfg.model)
    _optim_rules(r, cfg.optim, cfg.trainer.max_steps)
    _diffusion_rules(r, cfg.diffusion)
    _trainer_rules(r, cfg.trainer)
    _log_rules(r, cfg.log)
    r.need(not cfg.trainer.fid_interval or (cfg.data.name == "digits" and not cfg.data.uses_energon),
           "trainer.fid_interval", cfg.trainer.fid_interval, "FID during training compares with the built-in digits "
           "only so far; set it to 0 and score checkpoints with python -m dit_mcore.evaluate --reference DIR")
    r.problems += cfg.data.problems()
    if r.problems:
        return r.problems
    # Cross-section: the model as built (its own shape rules, the shape its data gives it) against the data,
    # the layout and the batch.
    problems = data_fit.contradictions(cfg)
    if problems:
        return problems
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model))
    data_fit.fit_model_to_data(cfg)
    try:
        model = cfg.model.build(ParallelConfig())
        _check_data_source(cfg.data, validates=cfg.trainer.val_interval > 0)
        _check_text(cfg.data, model, get_family(cfg.model.family))
        check_layout(cfg.parallel, model, cfg.data, world_size,
                     use_distributed_optimizer=cfg.optim.use_distributed_optimizer)
        if cfg.model.fp8 and cfg.model.backend == "te":
            te_fp8.check_machine(cfg)  # (its layout's rules: with the settings' below)
        elif cfg.model.fp8 and not cfg.trainer.bf16 and torch.cuda.is_available():
            raise ConfigError(f"model.fp8={cfg.model.fp8!r} needs trainer.bf16=True on a GPU (float8 GEMMs with fp32 "
                              "outputs are not supported on every GPU); set trainer.bf16=True")
        if cfg.parallel.tp_comm_overlap:
            tp_comm_overlap.check_run(cfg.model, cfg.trainer.bf16)
        check_settings_with_layout(cfg, model, world_size)
        cfg.data.num_microbatches(cfg.parallel.data_parallel_size(world_size))
    except ConfigError as e:
        return [str(e)]
    return []


def check_settings_with_layout(cfg, model, world_size: int) -> None:
    """The run's optimizer, EMA and precision settings against its layout (FSDP, the distributed optimizer; TE's
    FP8 against the ranks' token counts): the rules a layout planner must apply to every layout it offers
    (:func:`dit_mcore.plan.search.accepted`), as :func:`run_problems` applies them to the run (``model``: the model
    config built from ``cfg``)."""
    if cfg.model.fp8 and cfg.model.backend == "te":
        te_fp8.check_layout(cfg, model, world_size)
    if cfg.trainer.ema_offload and cfg.parallel.fsdp != "none":
        raise ConfigError(f"trainer.ema_offload=True with parallel.fsdp={cfg.parallel.fsdp!r}: FSDP shards the EMA "
                          "shadow over the data-parallel ranks already; set trainer.ema_offload=False")
    if cfg.trainer.ema_shard and (not cfg.optim.use_distributed_optimizer or cfg.parallel.fsdp != "none"):
        raise ConfigError("trainer.ema_shard=True splits the EMA like the distributed optimizer's state: it needs "
                          "optim.use_distributed_optimizer=True under parallel.fsdp='none' (FSDP shards the EMA "
                          "already); set trainer.ema_shard=None to choose automatically")
    if cfg.optim.split_main_params:
        _check_split_main_params(cfg)
    if cfg.optim.cpu_offload:
        check_cpu_offload(cfg)
    if cfg.optim.main_grads_dtype == "bf16" and not cfg.trainer.bf16:
        raise ConfigError("optim.main_grads_dtype='bf16' needs trainer.bf16=True (an fp32 model's gradients are "
                          "fp32); set trainer.bf16=True or optim.main_grads_dtype=fp32")
    if cfg.optim.main_grads_dtype == "bf16" and cfg.parallel.fsdp != "none":
        raise ConfigError(f"optim.main_grads_dtype='bf16' with parallel.fsdp={cfg.parallel.fsdp!r}: bf16 gradient "
                          "buffers are megatron DDP's (FSDP reduces its own way); set optim.main_grads_dtype=fp32 "
                          "or parallel.fsdp=none")
    if moments_below_fp32(cfg.optim) and cfg.parallel.fsdp != "none":
        raise ConfigError(f"optim.exp_avg_dtype / exp_avg_sq_dtype 'bf16' with parallel.fsdp={cfg.parallel.fsdp!r}: "
                          "FSDP steps torch's AdamW, whose moments are fp32; set both to fp32 (FSDP shards them "
                          "over the data-parallel ranks already)")
    if cfg.parallel.overlap_param_gather and not cfg.optim.use_distributed_optimizer:
        raise ConfigError("parallel.overlap_param_gather=True needs optim.use_distributed_optimizer=True "
                          "(only sharded parameters are gathered)")


def _check_text(data, model, family) -> None:
    """A text family needs data with text (of the model's width: :mod:`dit_mcore.training.data_fit`)."""
    if "text" not in family.conditioning:
        return
    if not data.path and data.name not in ("mock", "moving_digits"):
        raise ConfigError(f"data.name={data.name!r} has no captions, but model.family={family.name} is conditioned "
                          "on text; use a prepared energon dataset (data.path=..., it carries text embeddings) "
                          "or data.name=mock")


def _check_data_source(data, validates: bool = False) -> None:
    data.check_source()
    if data.val_path and not data.uses_energon:
        raise ConfigError(f"data.val_path={data.val_path!r} is for prepared energon datasets; the built-in "
                          f"data.name={data.name!r} validates on its own held-out split: unset data.val_path")
    if validates and data.blend and not data.val_path:
        raise ConfigError("trainer.val_interval: a blend has no val split of its own; set data.val_path to a prepared "
                          "dataset to validate on, or trainer.val_interval=0")
    if data.val_path and not (Path(data.val_path) / ".nv-meta").is_dir():
        raise ConfigError(f"data.val_path={data.val_path!r} is not a prepared energon dataset (no .nv-meta/ inside); "
                          "point it at the output of `python -m energon_data.prepare` (or unset it to validate on "
                          "the val split of data.path)")
    if validates and data.path and not data.val_path and not _has_val_split(Path(data.path)):
        raise ConfigError(f"trainer.val_interval: the val split of data.path={data.path!r} is empty; prepare it with "
                          "--split-ratio (e.g. 0.95,0.05,0), set data.val_path to a prepared dataset, or set "
                          "trainer.val_interval=0")
    if data.path:
        path = Path(data.path)
        if not path.exists():
            raise ConfigError(f"data.path={data.path!r} does not exist; prepare a dataset with "
                              "`python -m energon_data.prepare INPUT OUT` and point data.path at OUT")
        if path.is_dir() and not (path / ".nv-meta").is_dir():
            raise ConfigError(f"data.path={data.path!r} is not a prepared energon dataset (no .nv-meta/ inside); "
                              "prepare one with `python -m energon_data.prepare INPUT OUT` and point data.path at OUT")


def _has_val_split(path: Path) -> bool:
    """Whether a prepared energon dataset lists shards in its ``val`` split (True when it cannot tell:
    a metadataset file, a layout this check does not know)."""
    import yaml
    split = path / ".nv-meta" / "split.yaml"
    if not split.is_file():
        return True
    parts = (yaml.safe_load(split.read_text()) or {}).get("split_parts", {})
    return bool(parts.get("val", True))


def check_run_dir_writable(cfg) -> None:
    """Create ``log.dir`` (and its ``checkpoints/``) where missing and write a probe file into each, so a
    run that could not save fails now, in one line, instead of after the model is built (on every rank
    when one fails)."""
    import tempfile

    from dit_mcore.training.checkpoint import agreed_failure
    problem = None
    for path in (Path(cfg.log.dir), Path(cfg.log.dir) / "checkpoints"):
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".writable-"):
                pass
        except OSError as e:
            problem = problem or ConfigError(f"log.dir={cfg.log.dir!r}: cannot write to {str(path)!r} "
                                             f"({e.strerror or e}); choose another log.dir or make it writable")
    if dist.is_initialized():  # every rank alike (a rank on another node may see another filesystem)
        reason = agreed_failure(problem)
        problem = problem or (ConfigError(reason.removeprefix("ConfigError: ")) if reason else None)
    if problem is not None:
        raise problem


def validate_run(cfg, world_size: int) -> None:
    """Raise one :class:`ConfigError` listing every problem of ``cfg`` (see :func:`run_problems`)."""
    problems = run_problems(cfg, world_size)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} config problems:\n  " + "\n  ".join(problems))


def config_sections(fn) -> dict[str, type]:
    """``{argument: config dataclass}`` of a task like ``recipes.entry.train`` (one argument per section)."""
    out = {}
    for name, hint in typing.get_type_hints(fn).items():
        cls = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        if dataclasses.is_dataclass(cls):
            out[name] = cls
    return out


def override_problem(arg: str, sections: dict[str, type]) -> Optional[str]:
    """The problem with one ``section.field=value`` command-line override, if its name is unknown."""
    if "=" not in arg or arg.startswith("-"):
        return None
    key = arg.split("=", 1)[0].rstrip("+")
    section, _, field = key.partition(".")
    if section == "run" or section not in sections and not field:
        return None  # executor options and nemo-run's own arguments
    if section not in sections:
        return f"{key}: unknown config section {section!r}{did_you_mean(section, sections)} (sections: {', '.join(sections)})"
    names = [f.name for f in dataclasses.fields(sections[section])]
    name = field.split(".", 1)[0]
    if name not in names:
        return f"{key}: {sections[section].__name__} has no field {name!r}{did_you_mean(name, names)}"
    return None
