"""Latent (pixel -> latent) and text (caption -> embedding) encoders, chosen by name.

Two registries map a name to a builder: ``LATENT_ENCODERS`` (``--encoder``) and
``TEXT_ENCODERS`` (``--text-encoder``). Tiny random-init encoders with a fixed seed exist
for tests and demos; real ones (diffusers VAEs, T5) load from a LOCAL folder only
(``local_files_only=True``): the tool never downloads weights.

Conventions: pixels are float32 ``[C, T, H, W]`` in [-1, 1] (T=1 for images); latents are
``[c, t, h, w]``; a caption becomes ``[L, D]`` with L >= 1 (an empty caption still yields
the encoder's special tokens, so every sample has a text embedding).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn


class EncodeError(ValueError):
    """A sample this encoder cannot take (e.g. wrong channel count); the sample is skipped."""


class EncoderConfigError(ValueError):
    """The encoder itself cannot be built (unknown name, bad option, missing model folder)."""


# --------------------------------------------------------------------------- interfaces


class LatentEncoder(ABC):
    """Maps pixels ``[C, T, H, W]`` in [-1, 1] to a latent ``[c, t, h, w]`` and back."""

    name: str = ""
    spatial_factor: int = 1
    """Pixels per latent pixel along H and W; input H, W must be multiples of it."""
    temporal_factor: int = 1
    """1: frames are encoded independently (t = T). k > 1: causal video VAE, T = 1 + k*n -> t = 1 + n."""
    in_channels: int | None = None
    """Channel count the encoder expects; None takes any. 1 <-> 3 channels are converted."""

    def valid_frames(self, num_frames: int) -> int:
        """Largest frame count <= ``num_frames`` this encoder accepts (0 if none)."""
        if num_frames < 1:
            return 0
        k = self.temporal_factor
        return num_frames if k == 1 else 1 + (num_frames - 1) // k * k

    def match_channels(self, pixels: torch.Tensor) -> torch.Tensor:
        c = pixels.shape[0]
        if self.in_channels is None or c == self.in_channels:
            return pixels
        if c == 1 and self.in_channels == 3:
            return pixels.expand(3, *pixels.shape[1:])
        if c == 3 and self.in_channels == 1:
            # ITU-R BT.601 luma, the same weights PIL uses for RGB -> L.
            weights = torch.tensor([0.299, 0.587, 0.114], dtype=pixels.dtype).view(3, 1, 1, 1)
            return (pixels * weights).sum(0, keepdim=True)
        raise EncodeError(f"encoder {self.name!r} expects {self.in_channels} channels, got {c}")

    def check_input(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.ndim != 4:
            raise EncodeError(f"expected pixels [C, T, H, W], got shape {tuple(pixels.shape)}")
        _, t, h, w = pixels.shape
        f = self.spatial_factor
        if h % f or w % f:
            raise EncodeError(f"encoder {self.name!r} needs H and W divisible by {f}, got {h}x{w}")
        if self.valid_frames(t) != t:
            raise EncodeError(f"encoder {self.name!r} needs 1 + {self.temporal_factor}*n frames, got {t}")
        return self.match_channels(pixels.float())

    @abstractmethod
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """float32 pixels ``[C, T, H, W]`` -> float32 latent ``[c, t, h, w]``."""

    @abstractmethod
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """Inverse of ``encode`` (approximate for VAEs): latent -> pixels in [-1, 1]."""


class TextEncoder(ABC):
    """Maps captions to per-token embeddings ``[L, dim]`` (no padding, L >= 1)."""

    name: str = ""
    dim: int = 0

    @abstractmethod
    def encode(self, captions: list[str]) -> list[torch.Tensor]:
        """One float32 ``[L_i, dim]`` tensor per caption."""


# --------------------------------------------------------------------------- registries

LATENT_ENCODERS: dict[str, Callable[..., LatentEncoder]] = {}
TEXT_ENCODERS: dict[str, Callable[..., TextEncoder]] = {}


def register_latent_encoder(*names: str):
    def wrap(builder):
        for n in names:
            LATENT_ENCODERS[n] = builder
        return builder

    return wrap


def register_text_encoder(*names: str):
    def wrap(builder):
        for n in names:
            TEXT_ENCODERS[n] = builder
        return builder

    return wrap


def _build(registry: dict, kind: str, option: str, name: str, path: str | None, opts: dict[str, Any]):
    if name not in registry:
        raise EncoderConfigError(f"unknown {kind} {name!r} for {option}; choose one of {sorted(registry)}")
    builder = registry[name]
    sig = inspect.signature(builder)
    try:
        sig.bind(path=path, **opts)
    except TypeError as e:
        raise EncoderConfigError(f"bad options {sorted(opts)} for {option} {name!r} (accepted: {sig}): {e}") from e
    return builder(path=path, **opts)


def build_latent_encoder(name: str, path: str | None = None, **opts: Any) -> LatentEncoder:
    """Build the latent encoder registered as ``name``; ``path`` is its local model folder if it needs one."""
    return _build(LATENT_ENCODERS, "latent encoder", "--encoder", name, path, opts)


def build_text_encoder(name: str, path: str | None = None, **opts: Any) -> TextEncoder:
    """Build the text encoder registered as ``name``; ``path`` is its local model folder if it needs one."""
    return _build(TEXT_ENCODERS, "text encoder", "--text-encoder", name, path, opts)


def _no_path(name: str, path: str | None, option: str) -> None:
    if path:
        raise EncoderConfigError(f"{option} is not used by the built-in {name!r} encoder; drop it")


def require_local_model(path: str | None, name: str, option: str, config_file: str = "config.json") -> Path:
    """Check ``path`` is an existing, non-empty local folder; the error names the option to fix."""
    if not path:
        raise EncoderConfigError(
            f"encoder {name!r} loads weights from a local folder: pass {option} /path/to/model "
            "(models are never downloaded)"
        )
    p = Path(path).expanduser()
    if not p.is_dir() or not any(p.iterdir()):
        raise EncoderConfigError(f"{option} {path!r} for encoder {name!r} is not an existing, non-empty folder")
    if not any(p.rglob(config_file)):
        raise EncoderConfigError(f"{option} {path!r} for encoder {name!r} has no {config_file} (not a saved model?)")
    return p


def _seeded(seed: int, make: Callable[[], nn.Module]) -> nn.Module:
    """Build a module with a fixed seed without touching the caller's global RNG stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make().eval()


@contextlib.contextmanager
def _single_thread():
    """Tiny models: intra-op thread fan-out costs more than the math (and thrashes a shared CPU)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _default_device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


# --------------------------------------------------------------------------- identity


class IdentityEncoder(LatentEncoder):
    """Pixel space: the latent is the pixels themselves (channels as they are)."""

    name = "identity"

    def encode(self, pixels):
        return self.check_input(pixels).clone()

    def decode(self, latent):
        return latent.float().clone()


@register_latent_encoder("identity")
def _identity(path: str | None = None) -> LatentEncoder:
    _no_path("identity", path, "--encoder-path")
    return IdentityEncoder()


# --------------------------------------------------------------------------- tiny VAE


class TinyVAE(nn.Module):
    """A small random-init convolutional VAE; frames are coded independently (2D convs)."""

    def __init__(self, in_channels: int, latent_channels: int, downsample: int, width: int):
        super().__init__()
        levels = int(math.log2(downsample))
        enc: list[nn.Module] = [nn.Conv2d(in_channels, width, 3, padding=1)]
        dec: list[nn.Module] = [nn.Conv2d(latent_channels, width, 3, padding=1)]
        for _ in range(levels):
            enc += [nn.SiLU(), nn.Conv2d(width, width, 4, stride=2, padding=1)]
            dec += [nn.SiLU(), nn.ConvTranspose2d(width, width, 4, stride=2, padding=1)]
        enc += [nn.SiLU(), nn.Conv2d(width, 2 * latent_channels, 3, padding=1)]
        dec += [nn.SiLU(), nn.Conv2d(width, in_channels, 3, padding=1), nn.Tanh()]
        self.encoder, self.decoder = nn.Sequential(*enc), nn.Sequential(*dec)
        self.latent_channels = latent_channels

    def forward(self, x):
        mean, logvar = self.encoder(x).chunk(2, dim=1)
        return mean, logvar


class TinyVAEEncoder(LatentEncoder):
    name = "tiny_vae"
    temporal_factor = 1

    def __init__(self, in_channels=3, latent_channels=4, downsample=4, width=16, seed=0):
        if downsample not in (2, 4):
            raise EncoderConfigError(f"tiny_vae: downsample must be 2 or 4, got {downsample}")
        self.in_channels, self.spatial_factor = in_channels, downsample
        self.vae = _seeded(seed, lambda: TinyVAE(in_channels, latent_channels, downsample, width))

    @torch.no_grad()
    def encode(self, pixels):
        x = self.check_input(pixels).transpose(0, 1)  # frames as the batch: [T, C, H, W]
        with _single_thread():
            mean, _ = self.vae(x)
        return mean.transpose(0, 1).contiguous()  # the mean, so encoding is deterministic

    @torch.no_grad()
    def decode(self, latent):
        with _single_thread():
            return self.vae.decoder(latent.float().transpose(0, 1)).transpose(0, 1).contiguous()


@register_latent_encoder("tiny_vae")
def _tiny_vae(path=None, in_channels=3, latent_channels=4, downsample=4, width=16, seed=0) -> LatentEncoder:
    _no_path("tiny_vae", path, "--encoder-path")
    return TinyVAEEncoder(in_channels, latent_channels, downsample, width, seed)


# --------------------------------------------------------------------------- diffusers VAEs


def _diffusers_subfolder(root: Path, subfolder: str | None) -> str | None:
    """Accept a VAE folder or a whole pipeline folder (which keeps the VAE in ``vae/``)."""
    if subfolder is None and not (root / "config.json").is_file() and (root / "vae" / "config.json").is_file():
        return "vae"
    return subfolder


class DiffusersVAEEncoder(LatentEncoder):
    """A diffusers VAE; image VAEs code frames independently, video VAEs code the clip.

    Latents are normalised the way the matching diffusers pipelines do it:
    ``(z - latents_mean) / latents_std * scaling_factor`` when the config has per-channel
    statistics (Wan, LTX), else ``(z - shift_factor) * scaling_factor`` (SD, SDXL, Flux, CogVideoX).
    """

    def __init__(self, vae: nn.Module, name: str, video: bool, device: torch.device):
        self.vae, self.name, self.video, self.device = vae, name, video, device
        cfg = vae.config
        self.in_channels = cfg.get("in_channels", 3)
        self.dtype = next(vae.parameters()).dtype
        blocks = cfg.get("block_out_channels")
        self.spatial_factor = int(
            getattr(vae, "spatial_compression_ratio", None)
            or cfg.get("scale_factor_spatial")
            or (2 ** (len(blocks) - 1) if blocks else 8)
        )
        self.temporal_factor = (
            int(
                getattr(vae, "temporal_compression_ratio", None)
                or cfg.get("temporal_compression_ratio")
                or cfg.get("scale_factor_temporal")
                or 1
            )
            if video
            else 1
        )
        self.scale = float(cfg.get("scaling_factor") or 1.0)
        self.shift = float(cfg.get("shift_factor") or 0.0)
        mean, std = cfg.get("latents_mean"), cfg.get("latents_std")
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1, 1) if mean is not None else None
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1, 1) if std is not None else None

    def _normalise(self, z):
        if self.mean is not None and self.std is not None:
            return (z - self.mean) / self.std * self.scale
        return (z - self.shift) * self.scale

    def _denormalise(self, z):
        if self.mean is not None and self.std is not None:
            return z / self.scale * self.std + self.mean
        return z / self.scale + self.shift

    @torch.no_grad()
    def encode(self, pixels):
        x = self.check_input(pixels).to(self.device, self.dtype)
        # image VAE: frames as the batch [T, C, H, W]; video VAE: one clip [1, C, T, H, W]
        x = x.unsqueeze(0) if self.video else x.transpose(0, 1)
        z = self.vae.encode(x).latent_dist.mean.float().cpu()
        z = z[0] if self.video else z.transpose(0, 1)
        return self._normalise(z).contiguous()

    @torch.no_grad()
    def decode(self, latent):
        z = self._denormalise(latent.float()).to(self.device, self.dtype)
        z = z.unsqueeze(0) if self.video else z.transpose(0, 1)
        x = self.vae.decode(z).sample.float().cpu()
        return (x[0] if self.video else x.transpose(0, 1)).contiguous()


def _torch_dtype(dtype: str) -> torch.dtype:
    try:
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    except KeyError:
        raise EncoderConfigError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}") from None


@register_latent_encoder("diffusers_vae")
def _diffusers_vae(path=None, subfolder=None, device=None, dtype="float32") -> LatentEncoder:
    root = require_local_model(path, "diffusers_vae", "--encoder-path")
    from diffusers import AutoencoderKL

    dev = _default_device(device)
    vae = AutoencoderKL.from_pretrained(
        str(root), subfolder=_diffusers_subfolder(root, subfolder), local_files_only=True,
        torch_dtype=_torch_dtype(dtype),
    )
    return DiffusersVAEEncoder(vae.to(dev).eval(), "diffusers_vae", video=False, device=dev)


@register_latent_encoder("diffusers_video_vae")
def _diffusers_video_vae(path=None, subfolder=None, device=None, dtype="float32", class_name=None) -> LatentEncoder:
    """The VAE class comes from ``class_name`` or the folder's ``config.json`` (``_class_name``)."""
    root = require_local_model(path, "diffusers_video_vae", "--encoder-path")
    import diffusers

    sub = _diffusers_subfolder(root, subfolder)
    config = json.loads(((root / sub) if sub else root).joinpath("config.json").read_text())
    cls_name = class_name or config.get("_class_name")
    cls = getattr(diffusers, cls_name or "", None)
    if cls is None:
        raise EncoderConfigError(
            f"--encoder-path {path!r}: cannot tell the diffusers VAE class (config _class_name={cls_name!r}); "
            "pass the encoder option class_name, e.g. AutoencoderKLWan"
        )
    dev = _default_device(device)
    vae = cls.from_pretrained(str(root), subfolder=sub, local_files_only=True, torch_dtype=_torch_dtype(dtype))
    return DiffusersVAEEncoder(vae.to(dev).eval(), "diffusers_video_vae", video=True, device=dev)


# --------------------------------------------------------------------------- tiny text encoder

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")


class TinyTextModel(nn.Module):
    def __init__(self, dim: int, vocab: int, heads: int, max_length: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_length, dim) * 0.02)
        self.layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.layer(self.embed(ids) + self.pos[: ids.shape[-1]])


class TinyTextEncoder(TextEncoder):
    """Hashed word tokens -> embedding + one transformer layer; random init with a fixed seed.

    Token ids come from a stable hash (blake2b), not Python's salted ``hash``, so embeddings
    are identical across processes. Id 0 is a BOS token prepended to every caption, which
    gives the empty caption a one-token embedding.
    """

    name = "tiny_text"

    def __init__(self, dim=32, vocab=4096, heads=2, max_length=64, seed=0):
        if dim % heads:
            raise EncoderConfigError(f"tiny_text: dim={dim} must be divisible by heads={heads}")
        self.dim, self.vocab, self.max_length = dim, vocab, max_length
        self.model = _seeded(seed, lambda: TinyTextModel(dim, vocab, heads, max_length))

    def token_ids(self, caption: str) -> list[int]:
        words = _TOKEN_RE.findall(caption.lower())
        ids = [1 + int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little") % (self.vocab - 1)
               for w in words]
        return [0, *ids][: self.max_length]

    @torch.no_grad()
    def encode(self, captions):
        with _single_thread():
            return [self.model(torch.tensor([self.token_ids(c)]))[0] for c in captions]


@register_text_encoder("tiny_text", "tiny")
def _tiny_text(path=None, dim=32, vocab=4096, heads=2, max_length=64, seed=0) -> TextEncoder:
    _no_path("tiny_text", path, "--text-encoder-path")
    return TinyTextEncoder(dim, vocab, heads, max_length, seed)


# --------------------------------------------------------------------------- T5


class T5TextEncoder(TextEncoder):
    """transformers ``T5EncoderModel``; each caption keeps its real tokens (incl. ``</s>``), no padding."""

    name = "t5"

    def __init__(self, model, tokenizer, max_length: int, device: torch.device):
        self.model, self.tokenizer, self.max_length, self.device = model, tokenizer, max_length, device
        self.dim = model.config.d_model

    @torch.no_grad()
    def encode(self, captions):
        tok = self.tokenizer(
            list(captions), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        hidden = self.model(input_ids=tok.input_ids, attention_mask=tok.attention_mask).last_hidden_state
        lengths = tok.attention_mask.sum(1).tolist()
        return [hidden[i, : max(n, 1)].float().cpu() for i, n in enumerate(lengths)]


@register_text_encoder("t5")
def _t5(path=None, max_length=512, device=None, dtype="float32") -> TextEncoder:
    """``path`` is a T5 encoder folder with its tokenizer, or a diffusers pipeline folder
    (``text_encoder/`` + ``tokenizer/``)."""
    root = require_local_model(path, "t5", "--text-encoder-path")
    try:
        from transformers import AutoTokenizer, T5EncoderModel
    except ImportError as e:
        raise EncoderConfigError("--text-encoder t5 needs the `transformers` package: pip install transformers") from e
    pipeline = (root / "text_encoder" / "config.json").is_file()
    dev = _default_device(device)
    model = T5EncoderModel.from_pretrained(
        str(root), subfolder="text_encoder" if pipeline else "", local_files_only=True,
        torch_dtype=_torch_dtype(dtype),
    )
    tokenizer = AutoTokenizer.from_pretrained(
        str(root), subfolder="tokenizer" if pipeline else "", local_files_only=True
    )
    return T5TextEncoder(model.to(dev).eval(), tokenizer, max_length, dev)
