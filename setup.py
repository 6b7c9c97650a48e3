"""dit-mcore: Diffusion Transformers on megatron-core.

Install torch first (``pip install torch==2.13.0`` on CPU machines, or the CUDA build of your
choice): torch is not pinned here so that ``pip install -e .`` never replaces an installed torch
with a different build.
"""
from setuptools import find_packages, setup

setup(
    name="dit-mcore",
    version="0.1.0",
    description="Scalable training backend for Diffusion Transformers on megatron-core",
    python_requires=">=3.10",
    # kernels/ and recipes/ install as dit_mcore.kernels and dit_mcore.recipes: bare top-level names
    # `kernels` and `recipes` would clash with PyPI packages of those names (Hugging Face's `kernels`).
    packages=find_packages(include=["dit_mcore*", "energon_data*"]) + ["dit_mcore.kernels", "dit_mcore.recipes"],
    package_dir={"dit_mcore.kernels": "kernels", "dit_mcore.recipes": "recipes"},
    package_data={"dit_mcore.evaluate": ["digits_features.pt"]},  # the digits FID features' weights (76 KB)
    install_requires=[
        "torch>=2.6",
        "megatron-core==0.16.1",
        "megatron-energon>=7.4,<8",
        "nemo-run==0.11.1",
        "leptonai<0.47",  # nemo-run 0.11.1 imports leptonai.api.v1, removed in 0.47
        "webdataset",
        "numpy",
        "pillow",
        "scikit-learn",  # the built-in digits dataset ships inside it
        "tensorboard",
        "tqdm",
        "einops",
        "av",  # video decoding/encoding for the prepare tool (wheel ships FFmpeg)
        "torchmetrics",  # FID (python -m dit_mcore.evaluate, trainer.fid_interval: the digits demo)
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]", "flash-attn"],
        "encoders": ["diffusers", "transformers", "safetensors"],
        "fp8": ["torchao==0.18.0"],  # model.fp8: float8 training of the transformer linears
        "test": ["pytest", "pytest-xdist", "diffusers", "transformers", "safetensors", "torchao==0.18.0", "matplotlib", "wandb"],
        "plot": ["matplotlib"],  # python -m dit_mcore.plot
        # FID on InceptionV3 features (python -m dit_mcore.evaluate --features inception). torch-fidelity needs
        # torchvision, and pip then picks torch and torchvision together: install it with your torch's torchvision.
        "inception": ["torch-fidelity"],
        "wandb": ["wandb"],  # log.wandb=true
        "bench": ["matplotlib", "diffusers"],  # benchmarks/throughput.py plots, the diffusers side by side
    },
)
