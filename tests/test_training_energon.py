"""Training from a prepared energon dataset: packed batches, per-sample noise, exact resume with
the loader state in the checkpoint, and clear errors for resumes energon cannot do exactly."""
import pytest
import torch

from dit_mcore.training.trainer import Trainer, pretrain
from energon_data.loader import DataResumeError
from test_training import losses, tiny_run


@pytest.fixture(scope="module")
def digits_dataset(tmp_path_factory):
    from energon_data.prepare import prepare_dataset
    out = tmp_path_factory.mktemp("digits_energon")
    prepare_dataset("digits", str(out), encoder="identity", image_size=(8, 8), samples_per_shard=300,
                    progress=False, workers=1)
    return str(out)


def energon_run(run_dir, path, *, max_steps=4, num_workers=0, restart=False):
    cfg = tiny_run(run_dir, max_steps=max_steps)
    cfg.data.path = path
    cfg.data.global_batch_size = 2  # packed sequences per step
    cfg.data.micro_batch_size = 1
    cfg.data.max_seq_len = 64  # 4 digits of 16 tokens per pack
    cfg.data.packing_buffer_size = 16
    cfg.data.num_workers = num_workers
    cfg.data.restart_data_on_mismatch = restart
    cfg.model.in_channels = 1
    return cfg


def test_packed_step_draws_one_noise_level_per_sample(tmp_path, digits_dataset):
    trainer = Trainer(energon_run(tmp_path, digits_dataset))
    seen = {}
    original = trainer.model[0].forward

    def spy(tokens, timesteps, labels, **kw):
        seen.update(tokens=tokens.shape[0], timesteps=timesteps.clone(), cu=kw["batch"].cu_seqlens.clone())
        return original(tokens, timesteps, labels, **kw)

    trainer.model[0].forward = spy
    metrics = trainer.train_step()
    n = seen["cu"].numel() - 1
    assert n == 4 and seen["timesteps"].shape == (n,) and seen["timesteps"].unique().numel() == n
    assert seen["tokens"] == 64 and metrics["samples"] == 8 and metrics["tokens"] == 128
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_energon_resume_is_bit_identical(tmp_path, digits_dataset):
    full = losses(pretrain(energon_run(tmp_path / "full", digits_dataset, max_steps=5)))
    cut = Trainer(energon_run(tmp_path / "cut", digits_dataset, max_steps=5))
    first = [cut.train_step()["loss"] for _ in range(3)]
    cut.save()
    resumed = Trainer(energon_run(tmp_path / "cut", digits_dataset, max_steps=5))
    assert first + losses(resumed.fit()) == full


def test_resume_with_other_num_workers_is_refused_or_restarted(tmp_path, digits_dataset):
    trainer = Trainer(energon_run(tmp_path, digits_dataset, max_steps=3))
    trainer.train_step()
    trainer.save()
    with pytest.raises(DataResumeError, match="num_workers"):
        Trainer(energon_run(tmp_path, digits_dataset, max_steps=3, num_workers=1))
    restarted = Trainer(energon_run(tmp_path, digits_dataset, max_steps=3, num_workers=1, restart=True))
    assert restarted.step == 1  # weights and optimizer resumed, data stream restarted


def test_a_resume_keeps_how_the_stream_is_split_over_ranks(tmp_path, digits_dataset):
    """``data.shard_over_ranks=True`` keeps per-rank loader states (energon's own split) and resumes exactly; a
    resume that changes the setting is refused naming it (the states do not carry over)."""
    sharded = energon_run(tmp_path / "full", digits_dataset, max_steps=3)
    sharded.data.shard_over_ranks = True
    full = losses(pretrain(sharded))
    cut = energon_run(tmp_path / "cut", digits_dataset, max_steps=3)
    cut.data.shard_over_ranks = True
    trainer = Trainer(cut)
    first = [trainer.train_step()["loss"]]
    trainer.save()
    del trainer
    with pytest.raises(DataResumeError, match=r"data.shard_over_ranks=True \(its loader state is per rank\)"):
        Trainer(energon_run(tmp_path / "cut", digits_dataset, max_steps=3))
    assert first + losses(Trainer(cut).fit()) == full


def test_mixed_image_and_video_blend_trains(tmp_path, digits_dataset):
    """Images and moving-digit videos blended 1:1 and packed together into the same sequences."""
    from energon_data.blend import write_blend
    from energon_data.prepare import prepare_dataset
    videos = tmp_path / "moving"
    prepare_dataset("moving_digits", str(videos), encoder="identity", image_size=(8, 8), frames=2,
                    num_videos=16, progress=False, workers=1)
    blend = write_blend(tmp_path / "blend.yaml", [(digits_dataset, 1.0), (str(videos), 1.0)])
    cfg = energon_run(tmp_path / "run", str(blend), max_steps=3)
    trainer = Trainer(cfg)
    grids = []
    original = trainer.model[0].forward

    def spy(tokens, timesteps, labels, **kw):
        grids.extend(kw["batch"].grids[:, 0].tolist())
        return original(tokens, timesteps, labels, **kw)

    trainer.model[0].forward = spy
    history = [trainer.train_step() for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert 1 in grids and 2 in grids  # image (t=1) and video (t=2) samples both reached the model


@pytest.fixture(scope="module")
def captioned_videos(tmp_path_factory):
    """A prepared energon dataset of captioned videos (moving digits, tiny-text captions)."""
    from energon_data.prepare import prepare_dataset
    out = tmp_path_factory.mktemp("moving_digits_energon")
    prepare_dataset("moving_digits", str(out), encoder="identity", image_size=(8, 8), frames=2, num_videos=24,
                    samples_per_shard=12, progress=False, workers=1)
    return str(out)


@pytest.mark.parametrize("family, preset", [("dit_xattn", "xattn-tiny"), ("llama", "llama-tiny"),
                                            ("stdit", "stdit-tiny")])
def test_text_families_train_on_energon_captions(tmp_path, captioned_videos, family, preset):
    """The captions' embeddings flow from the prepared shards through packing to each text family:
    every packed sample carries its own caption, and a step trains on them."""
    from energon_data.prepare import prepare_record
    cfg = energon_run(tmp_path, captioned_videos, max_steps=2)
    cfg.model.family, cfg.model.preset, cfg.model.num_classes = family, preset, 10
    cfg.data.max_seq_len = 96  # 3 clips of 2 x 4 x 4 tokens per pack
    trainer = Trainer(cfg)
    seen = []
    original = trainer.model[0].forward

    def spy(tokens, timesteps, labels, **kw):
        seen.append((kw["batch"], kw["context"]))
        return original(tokens, timesteps, labels, **kw)

    trainer.model[0].forward = spy
    metrics = [trainer.train_step() for _ in range(2)]
    width = prepare_record(captioned_videos)["shards"][0]["text_dim"]
    for batch, context in seen:
        assert batch.has_text and batch.text_emb.shape[1] == width == trainer.model_config.text_dim
        assert context.num_samples == batch.num_samples == len(batch.text_seqlens)
        assert all(n > 0 for n in batch.text_seqlens)
    assert max(batch.num_samples for batch, _ in seen) >= 2  # packs of several captioned clips
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
