"""``trainer.init_from``: a run starts from another run's checkpoint or from diffusers weights (the model and its
EMA equal the source's, the optimizer and the step start fresh, unset shape fields come from the source), a
restart resumes its own checkpoint instead; ``python -m dit_mcore.convert SRC OUT --to checkpoint`` brings
diffusers weights in as a checkpoint that computes what diffusers computes; bad sources are one line."""
import dataclasses

import pytest
import torch

from dit_mcore.errors import ConfigError
from dit_mcore.training.config import ModelConfig
from dit_mcore.training.trainer import Trainer
from energon_data.config import DataConfig
from test_interop import _close, _diffusers_forward, _inputs, _tiny_diffusers
from test_training import tiny_run


def _state(module) -> dict:
    return {k: v.detach().float().clone() for k, v in module.state_dict().items() if torch.is_tensor(v)}


def _equal(ours: dict, want: dict) -> None:
    assert set(want) <= set(ours)
    for name, tensor in want.items():
        assert torch.equal(ours[name], tensor), name


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny DiT trained 3 steps: its run directory, EMA and trained weights."""
    run_dir = tmp_path_factory.mktemp("source")
    trainer = Trainer(tiny_run(run_dir, max_steps=3))
    trainer.fit()
    return run_dir, _state(trainer.ema.module[0]), _state(trainer.model[0])


@pytest.mark.parametrize("weights", ["ema", "model"])
def test_a_run_starts_from_another_runs_weights_with_a_fresh_optimizer(trained, tmp_path, weights):
    run_dir, ema, model = trained
    cfg = tiny_run(tmp_path / "tuned", max_steps=5)
    cfg.model.num_layers = cfg.model.hidden_size = None  # (unset: taken from the source)
    cfg.trainer = dataclasses.replace(cfg.trainer, init_from=str(run_dir), init_weights=weights)
    tuned = Trainer(cfg)
    want = ema if weights == "ema" else model
    assert tuned.step == 0 and cfg.model.num_layers == 2 and cfg.model.hidden_size == 32
    _equal(_state(tuned.model[0]), want)
    _equal(_state(tuned.ema.module[0]), want)
    assert not tuned.optimizer.state_dict()["state"]  # no moments: a fresh optimizer
    assert tuned.scheduler.state_dict()["num_steps"] == 0  # the learning-rate schedule from its start
    tuned.train_steps(2)
    tuned.save()
    del tuned
    restart = tiny_run(tmp_path / "tuned", max_steps=5)  # the same command again, shape fields unset
    restart.model.num_layers = restart.model.hidden_size = None
    restart.trainer = dataclasses.replace(restart.trainer, init_from=str(tmp_path / "nowhere-now"))
    again = Trainer(restart)  # resumes its own checkpoint (init_from unused), with the shape it recorded
    assert again.step == 2 and (restart.model.num_layers, restart.model.hidden_size) == (2, 32)


def test_a_model_built_on_the_meta_device_starts_from_the_source_too(trained, tmp_path):
    run_dir, ema, _ = trained
    cfg = tiny_run(tmp_path / "meta")
    cfg.model.init_model_with_meta_device = True
    cfg.trainer = dataclasses.replace(cfg.trainer, init_from=str(run_dir))
    trainer = Trainer(cfg)
    _equal(_state(trainer.model[0]), ema)
    _equal(_state(trainer.ema.module[0]), ema)


def test_diffusers_weights_come_in_as_a_checkpoint_that_computes_what_diffusers_does(tmp_path):
    from dit_mcore.convert.__main__ import main
    from dit_mcore.generate.checkpoint import build_model
    from dit_mcore.models.dit.interop import reference_forward
    from dit_mcore.parallel.config import ParallelConfig
    from dit_mcore.training.weights import find_checkpoint, load_weights, read_run, weights_model_config
    d = _tiny_diffusers()
    d.save_pretrained(tmp_path / "diffusers")
    assert main([str(tmp_path / "diffusers"), str(tmp_path / "imported"), "--to", "checkpoint"]) == 0
    path = find_checkpoint(tmp_path / "imported")
    run = read_run(path)
    assert run.diffusion.objective == "ddpm" and run.model.timestep_freq_shift == 1.0
    chunks, config = build_model(weights_model_config(run.model), ParallelConfig(), dtype=torch.float32,
                                 device="cpu")
    for weights in ("ema", "model"):  # (both names hold the imported weights)
        load_weights(chunks, path, weights=weights, run=run, model_config=config)
        x, t, y = _inputs()
        with torch.no_grad():
            _close(reference_forward(chunks[0], x, t, y), _diffusers_forward(d, x, t, y))


def test_a_run_starts_from_diffusers_weights(tmp_path):
    from dit_mcore.convert import load_diffusers
    _tiny_diffusers().save_pretrained(tmp_path / "diffusers")
    cfg = tiny_run(tmp_path / "run", max_steps=2)
    cfg.model = ModelConfig(preset="tiny")  # every shape field from the source
    cfg.data = DataConfig(name="mock", global_batch_size=4, micro_batch_size=4)
    cfg.trainer = dataclasses.replace(cfg.trainer, init_from=str(tmp_path / "diffusers"))
    trainer = Trainer(cfg)
    assert (cfg.model.hidden_size, cfg.model.in_channels, cfg.model.timestep_freq_shift) == (64, 4, 1.0)
    _equal(_state(trainer.model[0]), _state(load_diffusers(str(tmp_path / "diffusers"))))
    assert not (tmp_path / "run" / "imported_weights").exists()  # (the converted copy is removed once read)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.fit())


def test_bad_sources_are_one_line_naming_the_field_and_the_fix(trained, tmp_path):
    run_dir, _, _ = trained
    cfg = tiny_run(tmp_path / "a")
    cfg.trainer = dataclasses.replace(cfg.trainer, init_from=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"trainer.init_from=.*nowhere.*no such file or directory"):
        Trainer(cfg)
    cfg = tiny_run(tmp_path / "b")
    cfg.model.hidden_size = 64  # the source is 32 wide
    cfg.trainer = dataclasses.replace(cfg.trainer, init_from=str(run_dir))
    with pytest.raises(ConfigError, match=r"model.hidden_size: checkpoint 32, this run 64.*trainer.init_from"):
        Trainer(cfg)


def _start_under_layouts(rank, world, cases):
    """Each case: a run started from its source under a 2-rank layout, saved at step 0 (its first weights)."""
    from dit_mcore.parallel.initialize import release_model_parallel_groups
    for cfg in cases:
        trainer = Trainer(cfg)
        assert trainer.step == 0
        trainer.save()
        del trainer
        release_model_parallel_groups()


def test_every_rank_starts_from_its_shards_of_the_source_under_tensor_and_pipeline_parallel(trained, tmp_path):
    """Tensor parallel from another run's checkpoint, pipeline parallel from diffusers weights (converted by
    rank 0, read by both), and FSDP2 and Megatron-FSDP (bf16) models built on the meta device, loaded into
    their shards after sharding: the step-0 checkpoint, gathered whole, holds the source's weights bit for
    bit (bf16-rounded for the bf16 run)."""
    from safetensors.torch import load_file

    from dist_utils import run_distributed
    from dit_mcore.convert import export_checkpoint, load_diffusers
    from dit_mcore.parallel.initialize import destroy_distributed, whole_model_world
    run_dir, ema, _ = trained
    _tiny_diffusers().save_pretrained(tmp_path / "diffusers")
    tp = tiny_run(tmp_path / "tp2")
    tp.parallel.tensor_model_parallel_size = 2
    tp.trainer = dataclasses.replace(tp.trainer, init_from=str(run_dir))
    pp = tiny_run(tmp_path / "pp2")
    pp.model = ModelConfig(preset="tiny")
    pp.data = DataConfig(name="mock", global_batch_size=4, micro_batch_size=2)
    pp.parallel.pipeline_model_parallel_size = 2
    pp.trainer = dataclasses.replace(pp.trainer, init_from=str(tmp_path / "diffusers"))
    fsdp = tiny_run(tmp_path / "fsdp_meta")
    fsdp.parallel.fsdp = "torch"
    megatron_fsdp = tiny_run(tmp_path / "mfsdp_meta_bf16")
    megatron_fsdp.parallel.fsdp, megatron_fsdp.trainer.bf16 = "megatron", True
    for cfg in (fsdp, megatron_fsdp):
        cfg.model.init_model_with_meta_device = True
        cfg.trainer = dataclasses.replace(cfg.trainer, init_from=str(run_dir))
    run_distributed(_start_under_layouts, 2, [tp, pp, fsdp, megatron_fsdp])
    whole_model_world()
    diffusers = _state(load_diffusers(str(tmp_path / "diffusers")))
    bf16 = {k: v.bfloat16().float() for k, v in ema.items()}
    for name, want in (("tp2", ema), ("pp2", diffusers), ("fsdp_meta", ema), ("mfsdp_meta_bf16", bf16)):
        for weights in ("model", "ema"):
            out = export_checkpoint(str(tmp_path / name), str(tmp_path / f"{name}_{weights}"), to="safetensors",
                                    weights=weights)
            _equal({k: v.float() for k, v in load_file(str(out)).items()}, want)
    destroy_distributed()
