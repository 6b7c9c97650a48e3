"""FID (python -m dit_mcore.evaluate) through torchmetrics: a set against itself is ~0, a set moved further
away scores higher, the value equals a float64 NumPy/SciPy computation on the same features, the digits
feature network reads held-out digits, too few samples are refused naming the minimum, and the command
evaluates a trained checkpoint end to end."""
import json
import os

import numpy as np
import pytest
import torch
from scipy import linalg

from dit_mcore.errors import ConfigError
from dit_mcore.evaluate.cli import main, reference_images
from dit_mcore.evaluate.features import digit_features
from dit_mcore.generate.grid import to_uint8
from dit_mcore.evaluate.fid import fid
from dit_mcore.training.config import DiffusionConfig, LogConfig, ModelConfig, OptimConfig, RunConfig, TrainerConfig
from dit_mcore.training.data import digits_split
from energon_data.config import DataConfig
from energon_data.datasets import load_digits


def _digits(size=16) -> torch.Tensor:
    images, _ = load_digits(size=size)
    return images


def _u8(images: torch.Tensor) -> torch.Tensor:
    return to_uint8(images).expand(-1, 3, -1, -1).contiguous()


def test_the_digits_features_read_held_out_digits():
    images, labels = digits_split(16, held_out=True)
    accuracy = (digit_features().classify(_u8(images)) == labels).float().mean().item()
    assert accuracy > 0.9, accuracy


def test_fid_of_a_set_with_itself_is_zero_and_grows_as_the_set_moves_away():
    real = _digits()
    net = digit_features()
    assert abs(fid(_u8(real), _u8(real), net)) < 1e-3
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(real.shape, generator=g)
    scores = [fid(_u8(real), _u8(real + s * noise), net) for s in (0.1, 0.3, 0.6)]
    assert 0.1 < scores[0] < scores[1] < scores[2], scores


def test_fid_equals_a_float64_scipy_computation_on_the_same_features():
    net = digit_features()
    real, fake = _u8(_digits()[:900]), _u8((_digits()[900:] + 0.2 * torch.randn(897, 1, 16, 16,
                                                  generator=torch.Generator().manual_seed(1))))
    with torch.no_grad():
        a, b = net(real).double().numpy(), net(fake).double().numpy()
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root = linalg.sqrtm(cov_a @ cov_b).real
    want = float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a + cov_b - 2 * root))
    assert fid(real, fake, net) == pytest.approx(want, rel=1e-4)


def test_too_few_samples_are_refused_naming_the_minimum():
    with pytest.raises(ConfigError, match=r"--num-samples \(generated images\): 64 images; FID on 64 features needs at "
                                          r"least 65 per set"):
        fid(_u8(_digits()), _u8(_digits()[:64]), digit_features())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from dit_mcore.training.trainer import pretrain
    run_dir = tmp_path_factory.mktemp("evaluate_run")
    pretrain(RunConfig(
        model=ModelConfig(preset="tiny", input_size=8, in_channels=1, num_classes=10, class_dropout_prob=0.1,
                          backend="local"),
        data=DataConfig(name="digits", image_size=8, global_batch_size=32, micro_batch_size=32),
        optim=OptimConfig(lr=1e-3, warmup_steps=1), diffusion=DiffusionConfig(objective="flow", sample_steps=4),
        trainer=TrainerConfig(max_steps=3, save_interval=1000),
        log=LogConfig(dir=str(run_dir), log_interval=1, sample_interval=0, progress_bar=False, tensorboard=False)))
    return run_dir


def test_the_command_writes_the_fid_of_a_checkpoint_with_its_settings(trained, tmp_path, capsys):
    out = tmp_path / "fid.json"
    assert main(["--checkpoint", str(trained), "--reference", "digits", "--num-samples", "70", "--steps", "2",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["features"] == "digits" and result["num_samples"] == 70 and result["reference_samples"] == 1797
    assert result["steps"] == 2 and result["cfg_scale"] == 1.5 and result["image_size"] == [8, 8]
    assert 0 < result["fid"] < 1e4 and np.isfinite(result["fid"])
    assert "FID " in capsys.readouterr().out


def test_reference_statistics_give_the_fid_of_their_images(trained, tmp_path, capsys):
    """--save-reference-stats writes the reference's mu and sigma (with n and the extractor's name); an .npz of
    them, ours or pytorch-fid's (mu and sigma alone), is a reference giving the images' FID; statistics of other
    features are refused in one line."""
    args = ["--checkpoint", str(trained), "--num-samples", "70", "--steps", "2"]
    stats = tmp_path / "digits.npz"
    assert main(args + ["--reference", "digits", "--out", str(tmp_path / "a.json"),
                        "--save-reference-stats", str(stats)]) == 0
    want = json.loads((tmp_path / "a.json").read_text())["fid"]
    saved = np.load(stats)
    assert saved["mu"].shape == (64,) and saved["sigma"].shape == (64, 64) and int(saved["n"]) == 1797
    assert str(saved["features"]) == "digits"
    np.savez(tmp_path / "pytorch_fid.npz", mu=saved["mu"], sigma=saved["sigma"])
    for reference in (stats, tmp_path / "pytorch_fid.npz"):
        assert main(args + ["--reference", str(reference), "--features", "digits", "--out", str(tmp_path / "b.json")]) == 0
        assert json.loads((tmp_path / "b.json").read_text())["fid"] == pytest.approx(want, rel=1e-9)
    capsys.readouterr()
    assert main(args + ["--reference", str(stats), "--features", "inception", "--out", str(tmp_path / "c.json")]) == 2
    assert "statistics of digits features; --features inception" in capsys.readouterr().err
    np.savez(tmp_path / "wide.npz", mu=np.zeros(8), sigma=np.eye(8))
    assert main(args + ["--reference", str(tmp_path / "wide.npz"), "--features", "digits", "--out",
                        str(tmp_path / "c.json")]) == 2
    assert "statistics of 8 features; the extractor has 64" in capsys.readouterr().err


def test_the_inception_extractor_builds_offline_from_a_weights_file(tmp_path, monkeypatch, capsys):
    """--features inception with --inception-weights FILE (an offline cluster): torchmetrics' InceptionV3 from the
    file, 2,048 features per uint8 image of any size; a missing file is one line. (Random weights of the
    published layout: the published FID file cannot be downloaded here. Skipped without torch-fidelity, which
    the test extras leave out: it needs torchvision, whose install moves torch off the pinned CPU build.)"""
    pytest.importorskip("torch_fidelity")
    import torch_fidelity.feature_extractor_inceptionv3 as tf_inception

    from dit_mcore.evaluate.features import build_extractor
    with monkeypatch.context() as patch:  # the layout's state dict, randomly initialised, without a download
        patch.setattr(tf_inception, "load_state_dict_from_url", lambda *a, **k: {})
        patch.setattr(tf_inception.FeatureExtractorInceptionV3, "load_state_dict", lambda self, *a, **k: None)
        state = tf_inception.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"]).state_dict()
    torch.save(state, tmp_path / "inception.pth")
    extractor = build_extractor("inception", str(tmp_path / "inception.pth"))
    features = extractor(_u8(_digits(16)[:3]))
    assert extractor.num_features == 2048 and features.shape == (3, 2048) and torch.isfinite(features).all()
    with pytest.raises(ConfigError, match="--features=inception: its weights could not be read"):
        build_extractor("inception", str(tmp_path / "missing.pth"))


def test_a_folder_of_images_is_a_reference(tmp_path):
    """The digits written as PNGs (in sub-folders) read back as the built-in reference does."""
    from PIL import Image
    for i, image in enumerate(to_uint8(_digits(8))[:, 0]):
        (tmp_path / str(i % 3)).mkdir(exist_ok=True)
        Image.fromarray(image.numpy(), mode="L").save(tmp_path / str(i % 3) / f"{i:04d}.png")
    got = reference_images(str(tmp_path), (8, 8))
    want = reference_images("digits", (8, 8))
    order = sorted(range(1797), key=lambda i: (str(i % 3), f"{i:04d}"))  # (files are read in path order)
    assert got.shape == (1797, 3, 8, 8) and torch.equal(got, want[order])


def test_bad_evaluation_requests_are_one_line(trained, tmp_path, capsys):
    assert main(["--checkpoint", str(trained), "--reference", "digits", "--num-samples", "10",
                 "--out", str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err.strip() == ("evaluate: error: --num-samples=10: FID on 64 digits features needs at "
                                               "least 65")
    assert main(["--checkpoint", str(trained), "--reference", str(tmp_path / "none"), "--num-samples", "70",
                 "--out", str(tmp_path / "x.json")]) == 2
    assert "neither 'digits', a folder of images nor an .npz" in capsys.readouterr().err


def _fid_run(run_dir) -> RunConfig:
    return RunConfig(
        model=ModelConfig(preset="tiny", input_size=8, in_channels=1, num_classes=10, class_dropout_prob=0.1,
                          backend="local"),
        data=DataConfig(name="digits", image_size=8, global_batch_size=32, micro_batch_size=16),
        optim=OptimConfig(lr=1e-3, warmup_steps=1), diffusion=DiffusionConfig(objective="flow", sample_steps=2),
        trainer=TrainerConfig(max_steps=4, save_interval=1000, fid_interval=2, fid_samples=70),
        log=LogConfig(dir=str(run_dir), log_interval=3, sample_interval=0, progress_bar=False, tensorboard=False))


def _fid_worker(rank, world, run_dir):
    from dit_mcore.evaluate.during_training import FIDDuringTraining
    from dit_mcore.training.trainer import pretrain
    cfg = _fid_run(run_dir)
    during = [h["eval/fid"] for h in pretrain(cfg, hooks=[FIDDuringTraining(cfg)]) if "eval/fid" in h]
    # the command under torchrun: CFG-parallel samples, rank 0 scores and writes
    out = os.path.join(run_dir, "fid_cfg2.json")
    code = main(["--checkpoint", run_dir, "--reference", "digits", "--num-samples", "70", "--out", out,
                 "parallel.cfg_parallel=2"])
    return during, code, os.path.exists(out)


def test_fid_during_training_is_logged_and_equals_the_commands(tmp_path):
    """trainer.fid_interval: FID of the EMA's samples at steps 2 and 4, in the history and metrics.jsonl; the last
    one equals the evaluate command's on the final checkpoint (the same items, seeds and sampler)."""
    from dit_mcore.evaluate.during_training import FIDDuringTraining
    from dit_mcore.training.trainer import pretrain
    cfg = _fid_run(tmp_path / "run")
    history = pretrain(cfg, hooks=[FIDDuringTraining(cfg)])
    assert [h["step"] for h in history if "eval/fid" in h] == [2, 4]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "eval/fid" in line] == [2, 4]  # (step 2 logged for it: log_interval=3)
    assert main(["--checkpoint", str(tmp_path / "run"), "--reference", "digits", "--num-samples", "70",
                 "--out", str(tmp_path / "fid.json")]) == 0
    assert json.loads((tmp_path / "fid.json").read_text())["fid"] == pytest.approx(history[-1]["eval/fid"], rel=1e-3)
    # two data-parallel ranks: every rank samples, rank 0 scores alone (no collective of its own), the same number
    from dist_utils import run_distributed
    (during0, code0, wrote0), (during1, code1, _) = run_distributed(_fid_worker, 2, str(tmp_path / "dp2"))
    assert during0 == pytest.approx([h["eval/fid"] for h in history if "eval/fid" in h], rel=1e-4)
    assert during1 == []
    # and the command under torchrun (CFG-parallel over the two ranks): the one-process command's number
    assert (code0, code1, wrote0) == (0, 0, True)
    cfg2 = json.loads((tmp_path / "dp2" / "fid_cfg2.json").read_text())
    assert cfg2["fid"] == pytest.approx(json.loads((tmp_path / "fid.json").read_text())["fid"], rel=1e-3)
    assert len(list((tmp_path / "dp2" / "fid_cfg2_samples").glob("*.png"))) >= 70


def test_fid_during_training_is_refused_for_other_data(tmp_path):
    from dit_mcore.training.validate import validate_run
    cfg = RunConfig(model=ModelConfig(preset="tiny", input_size=8, in_channels=4, num_classes=10, backend="local"),
                    data=DataConfig(name="mock", image_size=8, global_batch_size=8),
                    trainer=TrainerConfig(max_steps=4, fid_interval=2), log=LogConfig(dir=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"trainer.fid_interval=2: FID during training compares with the built-in "
                                          r"digits only so far"):
        validate_run(cfg, 1)
