"""Parallel layout of a run, with megatron-core's ``ModelParallelConfig`` field names."""
from dataclasses import dataclass
from typing import Optional

from dit_mcore.errors import ConfigError

CP_COMM_TYPES = ("p2p", "a2a", "all_gather", "a2a+p2p")
FSDP_KINDS = ("none", "torch", "megatron")


@dataclass
class ParallelConfig:
    """How the world is split. Data parallel size is whatever is left of the world."""

    tensor_model_parallel_size: int = 1
    """Tensor parallel degree (splits attention heads and MLP width)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages (splits layers)."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank (interleaved 1F1B); None: one chunk."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Uneven pipeline split: layers on the first stage (the rest split evenly)."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Uneven pipeline split: layers on the last stage."""
    context_parallel_size: int = 1
    """Context parallel degree (splits the token sequence of every micro-batch)."""
    cp_comm_type: str = "p2p"
    """Context-parallel attention: "p2p" (ring), "a2a" (Ulysses), "all_gather" (gather K/V) or
    "a2a+p2p" (Ulysses inside a ring; needs ``hierarchical_context_parallel_sizes``)."""
    hierarchical_context_parallel_sizes: Optional[list[int]] = None
    """For ``cp_comm_type="a2a+p2p"``: ``[a2a_size, p2p_size]`` with product ``context_parallel_size``
    (a2a groups are contiguous ranks: keep them inside a node)."""
    sequence_parallel: bool = False
    """Shard activations outside TP regions along the sequence (requires TP > 1)."""
    overlap_grad_reduce: bool = False
    """megatron DDP: start each gradient bucket's reduction during the backward pass."""
    overlap_param_gather: bool = False
    """megatron DDP with the distributed optimizer: gather updated parameters during the next
    forward (a save, and a fold of a replicated EMA, force the gather first)."""
    ddp_bucket_size: Optional[int] = None
    """With ``overlap_grad_reduce``: parameters per bucket of megatron DDP's gradient reduction (and
    of the distributed optimizer's parameter gather); smaller buckets start communicating sooner,
    larger ones launch fewer collectives. None: megatron's max(40M, 1M x DP). (Without the overlap
    megatron reduces one bucket.)"""
    tp_comm_overlap: bool = False
    """Transformer Engine: overlap the sequence-parallel all-gathers and reduce-scatters with the
    linears' GEMMs (userbuffers). Needs TE on a GPU (``model.backend=te``), TP > 1 with
    ``sequence_parallel``, bf16, dense fixed-length micro-batches and a model without text
    cross-attention (TE has no userbuffer for its projections)."""
    expert_model_parallel_size: int = 1
    """MoE: ranks the experts of each layer are spread over (tokens travel by all-to-all)."""
    expert_tensor_parallel_size: Optional[int] = None
    """MoE: tensor-parallel degree inside each expert; None: the same as tensor_model_parallel_size."""
    fsdp: str = "none"
    """Fully sharded data parallelism over the data x context parallel ranks: "none" (megatron DDP,
    optionally with the distributed optimizer), "torch" (FSDP2 through megatron's
    ``TorchFullyShardedDataParallel``: parameters, gradients and optimizer state sharded) or
    "megatron" (Megatron-FSDP, GPU only)."""
    fsdp_shard_size: Optional[int] = None
    """HSDP: shard within groups of this many data x context parallel ranks and replicate across the
    groups (keep a group inside a node); None: shard over all of them."""
    layout: Optional[str] = None
    """"auto": the layout planner's first choice for this run on this job's GPUs (``python -m dit_mcore.plan``)
    sets the layout fields above, ``data.micro_batch_size``, ``model.recompute_*`` and ``model.chunk_tokens``;
    it is logged with its prediction and written to ``<log.dir>/plan.json`` (``docs/planning.md``). None: the
    fields as given."""
    layout_gpu: Optional[str] = None
    """With ``layout="auto"``: the planner's GPU to plan for (``H100-80GB``, ``H200``, ``B200``, ``A100-80GB``);
    None: this job's CUDA device, by its name."""

    def __post_init__(self):
        if self.virtual_pipeline_model_parallel_size == 1:  # one chunk per stage: megatron's None
            self.virtual_pipeline_model_parallel_size = None

    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def token_shards(self) -> int:
        """Ranks one micro-batch's token stream is split over (CP, times TP under sequence parallel)."""
        return self.context_parallel_size * (self.tensor_model_parallel_size if self.sequence_parallel else 1)

    def fsdp_replicas(self, world_size: int) -> int:
        """HSDP replica groups (1 without HSDP): data x context parallel ranks / ``fsdp_shard_size``."""
        if self.fsdp == "none" or not self.fsdp_shard_size:
            return 1
        return self.data_parallel_size(world_size) * self.context_parallel_size // self.fsdp_shard_size

    def expert_tensor_size(self) -> int:
        """The tensor-parallel degree inside each expert (``expert_tensor_parallel_size``, else TP's)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def expert_data_parallel_size(self, world_size: int) -> int:
        """Ranks holding the same experts (megatron's expert data parallel size)."""
        return world_size // (self.expert_tensor_size() * self.expert_model_parallel_size
                              * self.pipeline_model_parallel_size)

    def data_parallel_size(self, world_size: int) -> int:
        mp = self.model_parallel_size()
        if world_size % mp:
            raise ConfigError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size x "
                f"pipeline_model_parallel_size x context_parallel_size = {mp}; change the parallel sizes "
                f"or the number of processes")
        return world_size // mp
