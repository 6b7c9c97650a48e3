"""The model fits its data by default (``dit_mcore.training.data_fit``): shape fields left unset come from
the dataset's record or the built-in source, and a set one that contradicts the data fails naming both."""
import numpy as np
import pytest
from PIL import Image

from dit_mcore.errors import ConfigError
from dit_mcore.parallel.config import ParallelConfig
from dit_mcore.training.config import (DataConfig, DiffusionConfig, LogConfig, ModelConfig, OptimConfig, RunConfig,
                                       TrainerConfig)
from dit_mcore.training.data_fit import fit_model_to_data
from dit_mcore.training.validate import run_problems


@pytest.fixture(scope="module")
def pets(tmp_path_factory):
    """A prepared dataset of 16x16 RGB images in two class folders (identity encoder, tiny text: 32 wide)."""
    from energon_data.prepare import prepare_dataset
    root = tmp_path_factory.mktemp("pets_in")
    for i, kind in enumerate(["cat", "cat", "dog", "dog"]):
        (root / kind).mkdir(exist_ok=True)
        pixels = np.random.default_rng(i).integers(0, 256, (16, 16, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / kind / f"{i}.png")
    out = tmp_path_factory.mktemp("pets")
    prepare_dataset(root, out, progress=False, workers=1)
    return str(out)


def run(tmp_path, data: DataConfig, **model) -> RunConfig:
    return RunConfig(model=ModelConfig(**{"preset": "tiny", **model}), data=data,
                     optim=OptimConfig(lr=1e-3, warmup_steps=0), diffusion=DiffusionConfig(objective="flow"),
                     trainer=TrainerConfig(max_steps=1, save_interval=1000),
                     log=LogConfig(dir=str(tmp_path / "run"), log_interval=1, sample_interval=0, progress_bar=False,
                                   tensorboard=False),
                     parallel=ParallelConfig())


def test_unset_shape_fields_come_from_a_prepared_dataset(pets, tmp_path):
    data = DataConfig(path=pets, global_batch_size=2, micro_batch_size=2)
    cfg = run(tmp_path, data)  # the tiny preset: 4 channels of 8x8, 10 classes
    assert fit_model_to_data(cfg) == {"in_channels": 3, "input_size": 16, "num_classes": 2}
    text = run(tmp_path, data, family="dit_xattn", preset="xattn-tiny", text_dim=None)
    fitted = fit_model_to_data(text)
    assert fitted["text_dim"] == 32 and "num_classes" not in fitted  # a text model without classes keeps none
    more_classes = run(tmp_path, data, num_classes=1000)  # (fine-tuning a model with more classes is fine)
    assert "num_classes" not in fit_model_to_data(more_classes) and more_classes.model.num_classes == 1000


def test_a_set_field_that_contradicts_the_data_fails_naming_both_values_and_the_fix(pets, tmp_path):
    data = DataConfig(path=pets, global_batch_size=2, micro_batch_size=2)
    cfg = run(tmp_path, data, input_size=8, num_classes=1)
    problems = run_problems(cfg, world_size=1)
    assert problems == [f"model.input_size=8 but the dataset at data.path={pets!r} has 16: set model.input_size=16, "
                        "or leave it unset to take the data's",
                        f"model.num_classes=1 but the dataset at data.path={pets!r} has 2 classes: set "
                        "model.num_classes=2 (or more; 0: unconditional), or leave it unset"]
    with pytest.raises(ConfigError, match="the model does not fit its data:\n  model.input_size=8"):
        fit_model_to_data(cfg)
    assert cfg.model.in_channels is None  # nothing was set


def test_built_in_sources_and_unlabelled_datasets(tmp_path):
    from energon_data.prepare import prepare_dataset
    cfg = run(tmp_path, DataConfig(name="digits", image_size=16, global_batch_size=2, micro_batch_size=2))
    assert fit_model_to_data(cfg) == {"in_channels": 1, "input_size": 16, "num_classes": 10}
    mock = run(tmp_path, DataConfig(name="mock", image_size=16, global_batch_size=2, micro_batch_size=2))
    assert fit_model_to_data(mock) == {}  # mock latents follow the model
    root = tmp_path / "photos"
    root.mkdir()
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(root / "a.png")
    prepare_dataset(root, tmp_path / "photos_out", progress=False, workers=1)
    cfg = run(tmp_path, DataConfig(path=str(tmp_path / "photos_out"), global_batch_size=1, micro_batch_size=1))
    assert fit_model_to_data(cfg) == {"in_channels": 3, "input_size": 8, "num_classes": 0}  # unconditional


def test_a_trainer_on_a_dataset_of_another_shape_builds_the_data_s_model(pets, tmp_path):
    """The issue's newcomer: the tiny recipe pointed at 16x16 RGB data trained an 8x8 model on it, silently."""
    from dit_mcore.training.trainer import Trainer
    cfg = run(tmp_path, DataConfig(path=pets, global_batch_size=2, micro_batch_size=2))
    trainer = Trainer(cfg)
    shape = trainer.model_config
    assert (shape.in_channels, shape.input_size, shape.num_classes) == (3, 16, 2)
    assert trainer.train_step()["loss"] > 0
    assert trainer._common_state()["run_config"]["model"]["input_size"] == 16  # generation reads this back


def test_a_resumed_run_keeps_the_shape_its_checkpoint_records(pets, tmp_path):
    """A run started before its data said otherwise (or with the preset's shape) resumes as it was trained."""
    cfg = run(tmp_path, DataConfig(path=pets, global_batch_size=2, micro_batch_size=2))
    recorded = {"family": "dit", "in_channels": 4, "input_size": 8, "num_classes": 10, "num_layers": 2}
    fitted = fit_model_to_data(cfg, recorded=lambda: recorded)
    assert fitted == {"in_channels": 4, "input_size": 8, "num_classes": 10}
