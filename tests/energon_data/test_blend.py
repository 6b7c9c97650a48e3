"""Blending: weight and epoch mode, by samples and by tokens, against closed-form expected shares."""
import itertools

import pytest
import yaml

from energon_data.blend import mean_tokens_per_sample, sample_weights, write_blend
from energon_data.loader import DataConfig, build_train_loader
from fixtures import mixed_specs, write_dataset

IMAGES = mixed_specs(60, seed=4, video_fraction=0.0, sizes=(4, 8))
VIDEOS = mixed_specs(40, seed=5, video_fraction=1.0, sizes=(8,), frames=(2, 4))


def _tokens(spec):
    return spec.frames * (spec.height // 2) * (spec.width // 2)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    return (write_dataset(root / "img", IMAGES, prefix="i", samples_per_shard=15),
            write_dataset(root / "vid", VIDEOS, prefix="v", samples_per_shard=10))


def _shares(cfg, batches):
    """Fractions of samples and of real tokens drawn from the image dataset."""
    n_img = n_all = t_img = t_all = 0
    for b in itertools.islice(build_train_loader(cfg, dp_rank=0, dp_size=1), batches):
        for key, n in zip(b.keys, b.seqlens.tolist()):
            n_all, t_all = n_all + 1, t_all + n
            if key.startswith("i"):
                n_img, t_img = n_img + 1, t_img + n
    return n_img / n_all, t_img / t_all


def _cfg(blend, mode, by):
    return DataConfig(blend=blend, blend_mode=mode, blend_by=by, max_seq_len=128, micro_batch_size=4,
                      num_workers=0, packing_buffer_size=32, shuffle_buffer_size=20, max_samples_per_sequence=5)


def test_mean_tokens_from_shard_headers(datasets):
    img, vid = datasets
    assert mean_tokens_per_sample(img, (1, 2, 2)) == sum(map(_tokens, IMAGES)) / len(IMAGES)
    padded = sum(-(-_tokens(s) // 16) * 16 for s in VIDEOS) / len(VIDEOS)
    assert mean_tokens_per_sample(vid, (1, 2, 2), pad_multiple=16) == padded


def test_weight_blend_by_samples(datasets, tmp_path):
    img, vid = datasets
    cfg = _cfg([(str(img), 0.7), (str(vid), 0.3)], "weight", "samples")
    cfg.blend_dir = str(tmp_path)
    samples, _ = _shares(cfg, 50)
    assert samples == pytest.approx(0.7, abs=0.05)


def test_weight_blend_by_tokens(datasets, tmp_path):
    img, vid = datasets
    m_img = sum(map(_tokens, IMAGES)) / len(IMAGES)
    m_vid = sum(map(_tokens, VIDEOS)) / len(VIDEOS)
    w = sample_weights([(str(img), 0.5), (str(vid), 0.5)], by="tokens")
    assert w[0] == pytest.approx((0.5 / m_img) / (0.5 / m_img + 0.5 / m_vid))
    cfg = _cfg([(str(img), 0.5), (str(vid), 0.5)], "weight", "tokens")
    cfg.blend_dir = str(tmp_path)
    _, tokens = _shares(cfg, 50)
    assert tokens == pytest.approx(0.5, abs=0.06)


def test_epoch_blend_repetitions(datasets, tmp_path):
    img, vid = datasets
    cfg = _cfg([(str(img), 1), (str(vid), 2)], "epoch", "samples")
    cfg.blend_dir = str(tmp_path)
    samples, _ = _shares(cfg, 50)
    assert samples == pytest.approx(60 / (60 + 2 * 40), abs=0.05)
    doc = yaml.safe_load(open(next(tmp_path.glob("*.yaml"))))
    assert [e["repetitions"] for e in doc["splits"]["train"]["blend_epochized"]] == [1, 2]


def test_blend_errors(datasets, tmp_path):
    img, vid = datasets
    with pytest.raises(ValueError, match="only applies to mode='weight'"):
        write_blend(tmp_path / "x.yaml", [(str(img), 1)], mode="epoch", by="tokens")
    with pytest.raises(ValueError, match="not a prepared energon dataset"):
        write_blend(tmp_path / "x.yaml", [(str(tmp_path), 1)])
    with pytest.raises(ValueError, match="must be > 0"):
        write_blend(tmp_path / "x.yaml", [(str(img), 0.0), (str(vid), 1.0)])
