import json

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from energon_data.encoders import build_text_encoder
from energon_data.prepare import main, prepare_dataset

FAST = dict(progress=False, workers=1)


def _load_all(path, split="train"):
    """Every sample of a prepared split, keyed by its json ``source`` (single rank, no workers)."""
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset, get_val_dataset

    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    if split == "train":
        ds = get_train_dataset(path, worker_config=wc, batch_size=None, shuffle_buffer_size=None,
                               max_samples_per_sequence=None, repeat=False)
    else:
        ds = get_val_dataset(path, split_part=split, worker_config=wc, batch_size=None)
    return {s.meta["source"]: s for s in get_loader(ds)}


def _rgb(seed, h, w):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _write_mp4(path, frames, fps=4):
    import av

    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = frames[0].shape[1], frames[0].shape[0], "yuv444p"
        s.options = {"crf": "0"}  # lossless, up to the RGB <-> YUV conversion
        for f in frames:
            c.mux(s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        c.mux(s.encode())


def _decode(path):
    import av

    with av.open(str(path)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


def _unit(array):
    return torch.from_numpy(np.asarray(array)).float() / 127.5 - 1


@pytest.fixture
def media_dir(tmp_path):
    root = tmp_path / "in"
    (root / "sub").mkdir(parents=True)
    Image.fromarray(_rgb(0, 16, 16)).save(root / "a.png")
    (root / "a.txt").write_text("a red square\n")
    Image.fromarray(_rgb(1, 16, 16)).save(root / "sub" / "b.png")
    Image.fromarray(_rgb(2, 16, 16)).save(root / "c.png")  # no caption at all
    frames = [np.roll(_rgb(3, 16, 16), 2 * t, axis=1) for t in range(5)]
    _write_mp4(root / "sub" / "v.mp4", frames)
    (root / "captions.jsonl").write_text(
        json.dumps({"file": "sub/b.png", "caption": "a blue thing"}) + "\n"
        + json.dumps({"file": "sub/v.mp4", "caption": "noise sliding right"}) + "\n"
        + json.dumps({"file": "a.png", "caption": "the sidecar wins"}) + "\n"
    )
    # bad media: each must be skipped with its reason
    (root / "broken.png").write_bytes(b"not a png at all")
    (root / "empty.mp4").write_bytes(b"")
    Image.fromarray(np.zeros((16, 16, 2), dtype=np.uint8), mode="LA").save(root / "two_channel.png")
    Image.fromarray(np.zeros((16, 16), dtype=np.uint8), mode="L").save(root / "gray.png")  # 1 vs 3 channels
    (root / "notes.xyz").write_text("?")
    return root, frames


def test_folder_round_trip_with_captions_and_bad_files(media_dir, tmp_path):
    root, frames = media_dir
    out = tmp_path / "out"
    summary = prepare_dataset(root, out, samples_per_shard=2, **FAST)
    assert summary.status == "prepared" and summary.samples == 4 and summary.shards == 2
    reasons = dict(summary.skipped)
    assert set(reasons) == {"broken.png", "empty.mp4", "two_channel.png", "gray.png", "notes.xyz"}
    assert "unreadable image" in reasons["broken.png"]
    assert "unreadable video" in reasons["empty.mp4"] or "zero frames" in reasons["empty.mp4"]
    assert "2-channel" in reasons["two_channel.png"]
    assert "--channels" in reasons["gray.png"]
    assert "unsupported file type .xyz" in reasons["notes.xyz"]
    assert "skipped: 5" in str(summary)

    dataset_yaml = yaml.safe_load((out / ".nv-meta" / "dataset.yaml").read_text())
    assert dataset_yaml["sample_type"] == {"__module__": "energon_data.samples", "__class__": "LatentSample"}

    samples = _load_all(out)
    assert set(samples) == {"a.png", "sub/b.png", "c.png", "sub/v.mp4"}
    text = build_text_encoder("tiny")
    captions = {"a.png": "a red square", "sub/b.png": "a blue thing", "c.png": "", "sub/v.mp4": "noise sliding right"}
    for src, s in samples.items():
        assert s.meta["caption"] == captions[src]
        assert s.latent.dtype == torch.bfloat16 and s.text_emb.dtype == torch.bfloat16
        assert torch.equal(s.text_emb, text.encode([captions[src]])[0].to(torch.bfloat16))
    # identity encoder: the latent is the source pixels, [C, T, H, W]
    for src, seed in (("a.png", 0), ("sub/b.png", 1), ("c.png", 2)):
        ref = _unit(_rgb(seed, 16, 16)).permute(2, 0, 1).unsqueeze(1)
        assert torch.equal(samples[src].latent, ref.to(torch.bfloat16))
        assert samples[src].meta | {"caption": None} == {
            "kind": "image", "height": 16, "width": 16, "frames": 1, "fps": None, "caption": None, "source": src}
    video = samples["sub/v.mp4"]
    decoded = torch.stack([_unit(f) for f in _decode(root / "sub" / "v.mp4")]).permute(3, 0, 1, 2)
    assert video.latent.shape == (3, 5, 16, 16)
    assert torch.equal(video.latent, decoded.to(torch.bfloat16))  # exactly what the decoder gives
    source = torch.stack([_unit(f) for f in frames]).permute(3, 0, 1, 2)
    assert (video.latent.float() - source).abs().mean() < 0.05  # and that is the video we wrote
    assert video.meta["kind"] == "video" and video.meta["frames"] == 5 and video.meta["fps"] == pytest.approx(4.0)


def test_rerun_is_idempotent_overwrite_redoes_and_options_are_checked(media_dir, tmp_path):
    root, _ = media_dir
    out = tmp_path / "out"
    first = prepare_dataset(root, out, samples_per_shard=2, **FAST)
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.tar")}
    again = prepare_dataset(root, out, samples_per_shard=2, **FAST)
    assert again.status == "up-to-date" and "nothing to do" in str(again)
    assert (again.samples, again.shards, again.skipped) == (first.samples, first.shards, first.skipped)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.tar")} == mtimes
    with pytest.raises(FileExistsError, match="--overwrite"):
        prepare_dataset(root, out, samples_per_shard=3, **FAST)
    redo = prepare_dataset(root, out, samples_per_shard=3, overwrite=True, **FAST)
    assert redo.status == "prepared" and redo.shards == 2
    assert sorted(p.name for p in out.glob("shard-*.tar")) == ["shard-000000.tar", "shard-000001.tar"]
    assert len(_load_all(out)) == 4


def test_interrupted_run_continues_after_last_finished_shard(media_dir, tmp_path):
    root, _ = media_dir
    out = tmp_path / "out"
    prepare_dataset(root, out, samples_per_shard=1, **FAST)
    reference = {k: s.latent for k, s in _load_all(out).items()}
    # simulate a crash after the first shard: later shards, energon metadata and completion are gone
    state = json.loads((out / "prepare_state.json").read_text())
    next_item = state["shards"][0]["next_item"]
    state.update(complete=False, shards=state["shards"][:1])
    state["skipped"] = [s for s in state["skipped"] if s[2] < next_item]
    (out / "prepare_state.json").write_text(json.dumps(state))
    for p in out.glob("shard-00000[1-9].tar"):
        p.unlink()
    (out / ".nv-meta" / "split.yaml").unlink()
    (out / ".shard-000001.tar.partial").write_bytes(b"half a shard")

    resumed = prepare_dataset(root, out, samples_per_shard=1, **FAST)
    assert resumed.status == "resumed" and resumed.resumed_shards == 1
    assert resumed.samples == 4 and len(resumed.skipped) == 5
    got = _load_all(out)
    assert set(got) == set(reference) and all(torch.equal(got[k].latent, reference[k]) for k in got)


def test_refuses_foreign_output_folder_and_bad_input(tmp_path, media_dir):
    root, _ = media_dir
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not written by energon_data.prepare"):
        prepare_dataset(root, tmp_path / "foreign", **FAST)
    with pytest.raises(FileNotFoundError, match="neither a folder nor a built-in"):
        prepare_dataset(tmp_path / "nowhere", tmp_path / "o", **FAST)
    with pytest.raises(TypeError, match="unknown options"):
        prepare_dataset(root, tmp_path / "o", imagesize=8)
    with pytest.raises(ValueError, match="--split-ratio"):
        prepare_dataset(root, tmp_path / "o", split_ratio=(1, 0), **FAST)


def test_resize_channels_and_tiny_vae(media_dir, tmp_path):
    root, _ = media_dir
    out = tmp_path / "out"
    summary = prepare_dataset(root, out, encoder="tiny_vae", image_size=8, channels=3, frames=3,
                              encoder_opts={"downsample": 2}, text_encoder_opts={"dim": 16}, **FAST)
    # gray.png is converted to RGB now; the other bad files are still skipped
    assert summary.samples == 5 and len(summary.skipped) == 4
    samples = _load_all(out)
    assert samples["gray.png"].latent.shape == (4, 1, 4, 4)
    assert samples["sub/v.mp4"].latent.shape == (4, 3, 4, 4)  # first 3 frames, 16px -> 8px -> 4 latent px
    assert samples["sub/v.mp4"].meta["height"] == 8 and samples["a.png"].text_emb.shape[-1] == 16


def test_digits_builtin_with_splits_and_cli(tmp_path, capsys):
    from energon_data.datasets import load_digits

    out = tmp_path / "digits"
    assert main([
        "digits", str(out), "--samples-per-shard", "200", "--split-ratio", "0.8,0.1,0.1", "--no-progress",
        "--workers", "1", "--image-size", "8",
    ]) == 0
    printed = capsys.readouterr().out
    assert "samples: 1797 in 9 shards" in printed and "skipped: 0" in printed
    split = yaml.safe_load((out / ".nv-meta" / "split.yaml").read_text())["split_parts"]
    assert set(split) == {"train", "val", "test"}

    parts = {name: _load_all(out, name) for name in ("train", "val", "test")}
    sizes = {k: len(v) for k, v in parts.items()}
    assert sum(sizes.values()) == 1797 and min(sizes.values()) > 0
    assert sizes["train"] == 1797 - sizes["val"] - sizes["test"] >= 1397  # 7 of 9 shards
    images, labels = load_digits(8)
    merged = {k: v for p in parts.values() for k, v in p.items()}
    assert len(merged) == 1797  # splits are disjoint
    for i in range(0, 1797, 97):
        s = merged[f"digits[{i}]"]
        assert torch.equal(s.latent, images[i].unsqueeze(1).to(torch.bfloat16))
        assert s.meta["label"] == int(labels[i]) and s.meta["caption"] == f"a handwritten {int(labels[i])}"

    # changing only the split re-splits without re-encoding
    again = prepare_dataset("digits", out, samples_per_shard=200, split_ratio=(1, 0, 0), image_size=8, **FAST)
    assert again.status == "resplit" and again.splits == {"train": 1797, "val": 0, "test": 0}
    assert main(["nowhere-folder", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "neither a folder nor a built-in" in capsys.readouterr().err


def test_moving_digits_builtin(tmp_path):
    out = tmp_path / "md"
    summary = prepare_dataset("moving_digits", out, num_videos=6, frames=4, image_size=16, **FAST)
    assert summary.samples == 6
    samples = _load_all(out)
    from energon_data.datasets import moving_digits

    ref = moving_digits(6, frames=4, size=16, seed=0)
    for i in range(6):
        s = samples[f"moving_digits[{i}]"]
        assert s.latent.shape == (1, 4, 16, 16)
        assert torch.equal(s.latent, ref.videos[i].to(torch.bfloat16))
        assert s.meta["caption"] == ref.captions[i] and s.meta["label"] == int(ref.labels[i])
        assert s.meta["kind"] == "video" and s.meta["fps"] == 8.0


def _folder(root, files):
    """``files``: relative path -> image seed (16x16 RGB PNGs)."""
    for rel, seed in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(_rgb(seed, 16, 16)).save(root / rel)
    return root


def test_class_sub_folders_become_labels_and_the_label_map_is_kept(tmp_path, capsys):
    from energon_data.prepare import prepare_record

    root = _folder(tmp_path / "in", {"dog/1.png": 0, "cat/2.png": 1, "cat/3.png": 2, "zebra/x/4.png": 3})
    out = tmp_path / "out"
    assert main([str(root), str(out), "--workers", "1"]) == 0
    assert "labels (3): 0=cat, 1=dog, 2=zebra" in capsys.readouterr().out
    assert prepare_record(out)["labels"] == ["cat", "dog", "zebra"]
    labels = {src: s.meta["label"] for src, s in _load_all(out).items()}
    assert labels == {"cat/2.png": 0, "cat/3.png": 0, "dog/1.png": 1, "zebra/x/4.png": 2}

    unlabelled = prepare_dataset(root, tmp_path / "none", labels="none", **FAST)
    assert unlabelled.labels is None and all("label" not in s.meta for s in _load_all(tmp_path / "none").values())
    _folder(root, {"loose.png": 4})  # a file outside every class folder: auto means no labels ...
    auto = prepare_dataset(root, tmp_path / "auto", **FAST)
    assert auto.labels is None and auto.samples == 5
    forced = prepare_dataset(root, tmp_path / "forced", labels="folders", **FAST)  # ... folders skips it
    assert forced.labels == ["cat", "dog", "zebra"] and forced.samples == 4
    assert dict(forced.skipped) == {"loose.png": "not in a class sub-folder (--labels folders)"}
    with pytest.raises(ValueError, match="--labels must be one of"):
        prepare_dataset(root, tmp_path / "bad", labels="yes", **FAST)
    flat = _folder(tmp_path / "flat", {"a.png": 0})
    with pytest.raises(ValueError, match="--labels folders: INPUT has no sub-folder holding media"):
        prepare_dataset(flat, tmp_path / "flat_out", labels="folders", **FAST)


def _spy_encodes(monkeypatch) -> list:
    """Patch the latent encoder prepare builds so that every source it encodes is counted."""
    import energon_data.prepare as prepare
    encoded, build = [], prepare._build_encoders

    def counting(cfg):
        latent, text = build(cfg)
        encode = latent.encode
        latent.encode = lambda pixels: encoded.append(pixels.shape) or encode(pixels)
        return latent, text
    monkeypatch.setattr(prepare, "_build_encoders", counting)
    return encoded


def test_a_rerun_encodes_just_the_changed_added_and_removed_sources(tmp_path, monkeypatch):
    from energon_data.prepare import prepare_record

    root = _folder(tmp_path / "in", {f"{i}.png": i for i in range(6)})
    (root / "4.txt").write_text("a caption")
    out = tmp_path / "out"
    prepare_dataset(root, out, samples_per_shard=2, **FAST)
    encoded = _spy_encodes(monkeypatch)
    _folder(root, {"1.png": 11, "9.png": 9})  # 1.png changed under the same name, 9.png added
    (root / "3.png").unlink()  # removed
    (root / "4.txt").write_text("another caption")  # a changed caption is a changed source
    updated = prepare_dataset(root, out, samples_per_shard=2, **FAST)
    assert updated.status == "updated" and len(encoded) == 3, (updated.status, encoded)
    assert updated.changes == {"changed": 2, "added": 1, "removed": 1, "reused": 3}
    assert "sources changed 2, added 1, removed 1; 3 samples reused without encoding" in str(updated)
    assert not list(out.glob(".previous-*"))
    fresh = tmp_path / "fresh"
    prepare_dataset(root, fresh, samples_per_shard=2, **FAST)
    got, want = _load_all(out), _load_all(fresh)
    assert set(got) == set(want) == {"0.png", "1.png", "2.png", "4.png", "5.png", "9.png"}
    for src in want:
        assert torch.equal(got[src].latent, want[src].latent) and torch.equal(got[src].text_emb, want[src].text_emb)
        assert got[src].meta == want[src].meta
    assert prepare_record(out)["shards"] == prepare_record(fresh)["shards"]
    # touched but unchanged: up to date, and nothing read again next time (the stat record is renewed)
    import os
    os.utime(root / "0.png", ns=(1, 1))
    encoded.clear()
    assert prepare_dataset(root, out, samples_per_shard=2, **FAST).status == "up-to-date" and not encoded
    assert prepare_record(out)["stats"]["0.png"][1] == 1


def test_an_interrupted_update_resumes_from_the_previous_shards(tmp_path, monkeypatch):
    import energon_data.prepare as prepare

    root = _folder(tmp_path / "in", {f"{i}.png": i for i in range(6)})
    out = tmp_path / "out"
    prepare_dataset(root, out, samples_per_shard=2, **FAST)
    _folder(root, {"5.png": 15})
    write, calls = prepare.shard_lib.write_shard, []

    def dies_at_the_second_shard(*args):
        calls.append(args[1])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return write(*args)
    monkeypatch.setattr(prepare.shard_lib, "write_shard", dies_at_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(root, out, samples_per_shard=2, **FAST)
    assert len(list(out.glob(".previous-shard-*.tar"))) == 3  # the samples the update takes are still there
    monkeypatch.setattr(prepare.shard_lib, "write_shard", write)
    encoded = _spy_encodes(monkeypatch)
    resumed = prepare_dataset(root, out, samples_per_shard=2, **FAST)
    assert resumed.status == "resumed" and resumed.resumed_shards == 1 and len(encoded) == 1  # 5.png
    prepare_dataset(root, tmp_path / "fresh", samples_per_shard=2, **FAST)
    got, want = _load_all(out), _load_all(tmp_path / "fresh")
    assert set(got) == set(want) and all(torch.equal(got[k].latent, want[k].latent) for k in want)
    assert not list(out.glob(".previous-*"))


def test_a_failed_prepare_leaves_nothing_that_looks_like_a_dataset(tmp_path):
    root = tmp_path / "in"
    root.mkdir()
    (root / "broken.png").write_bytes(b"not a png")
    with pytest.raises(RuntimeError, match="no sample could be prepared"):
        prepare_dataset(root, tmp_path / "out", **FAST)
    assert not (tmp_path / "out").exists()
    (tmp_path / "mine").mkdir()  # a folder the user made stays, empty
    assert main([str(root), str(tmp_path / "mine"), "--workers", "1"]) == 2
    assert list((tmp_path / "mine").iterdir()) == []


def test_an_update_keeps_one_channel_count_and_a_failed_one_keeps_the_dataset(tmp_path):
    """As a fresh prepare: the first sample's channels hold for the reused ones too. An INPUT emptied (an
    unmounted share) refuses and keeps the dataset; an update that fails keeps what it set aside."""
    root = _folder(tmp_path / "in", {"a.png": 0, "c.png": 2})
    Image.fromarray(np.zeros((16, 16), dtype=np.uint8), mode="L").save(root / "b.png")  # grey: skipped
    out = tmp_path / "out"
    assert prepare_dataset(root, out, **FAST).samples == 2
    _folder(root, {"d.png": 3})
    updated = prepare_dataset(root, out, **FAST)
    fresh = prepare_dataset(root, tmp_path / "fresh", **FAST)
    assert updated.samples == fresh.samples == 3 and dict(updated.skipped).keys() == dict(fresh.skipped).keys()
    assert {s.latent.shape[0] for s in _load_all(out).values()} == {3}
    root.rename(tmp_path / "away")  # the same INPUT, empty (an unmounted share)
    root.mkdir()
    with pytest.raises(FileNotFoundError, match="holds no media now; the dataset in OUT .* is kept"):
        prepare_dataset(root, out, **FAST)
    assert len(_load_all(out)) == 3
    root.rmdir()
    (tmp_path / "away").rename(root)
    (root / "e.png").write_bytes(b"broken")  # an update that fails after setting the shards aside
    import energon_data.prepare as prepare
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prepare, "_encode_items", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            prepare_dataset(root, out, **FAST)
    assert len(list(out.glob(".previous-shard-*.tar"))) == 1 and (out / "prepare_state.json").exists()
    assert prepare_dataset(root, out, **FAST).samples == 3 and len(_load_all(out)) == 3


def test_unchanged_files_are_not_read_again(tmp_path, monkeypatch):
    import os

    import energon_data.prepare as prepare
    root = _folder(tmp_path / "in", {"a.png": 0, "b.png": 1})
    for name in ("a.png", "b.png"):  # modified well before the digests are recorded (not "racy")
        os.utime(root / name, ns=(10**18, 10**18))
    out = tmp_path / "out"
    prepare_dataset(root, out, **FAST)
    read, digest = [], prepare._file_digest
    monkeypatch.setattr(prepare, "_file_digest", lambda path: read.append(path.name) or digest(path))
    assert prepare_dataset(root, out, **FAST).status == "up-to-date" and read == []
    _folder(root, {"b.png": 5})  # rewritten: its stamp changed
    os.utime(root / "b.png", ns=(10**18, 10**18))  # even with the old modification time put back (cp -p)
    assert prepare_dataset(root, out, **FAST).status == "updated" and read == ["b.png"]
