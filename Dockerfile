# syntax=docker/dockerfile:1
# dit-mcore on an NGC PyTorch image, which already ships CUDA torch, Transformer Engine, apex and
# flash-attn. Build:  docker build -t dit-mcore .
# Run (one node):     docker run --gpus all --ipc=host --rm -it dit-mcore \
#                         torchrun --nproc-per-node 8 recipes/pretrain_xl.py --yes --factory pretrain_xl data.path=...
# Slurm (pyxis) uses the image via recipes' `run.executor=slurm run.executor.container_image=<registry>/dit-mcore`.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.09-py3
FROM ${BASE_IMAGE}

# megatron-core overlaps tensor/sequence-parallel communication with compute only when the GPU
# runs kernels in issue order.
ENV CUDA_DEVICE_MAX_CONNECTIONS=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /opt/dit-mcore
COPY . .

# Pin the image's own torch (an NGC build such as 2.9.0a0+...nv25.09) so that resolving
# megatron-core, nemo-run and friends can never replace it with a PyPI wheel; TE and flash-attn
# are the image's too, so the [gpu] extra is not installed.
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch-constraint.txt \
 && pip install --constraint /tmp/torch-constraint.txt -e ".[encoders]" \
 && python -c "import torch, dit_mcore, energon_data, dit_mcore.kernels, dit_mcore.recipes.entry; print('torch', torch.__version__)"

# No ENTRYPOINT/CMD of our own: the base image's entrypoint stays, and the command is the user's.
