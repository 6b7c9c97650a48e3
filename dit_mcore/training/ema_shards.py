"""The EMA shadow split like the distributed optimizer's state (``trainer.ema_shard``): each
data-parallel rank keeps, in fp32, the EMA of its own shard of every bucket of megatron DDP's
parameter buffer -- the shard the distributed optimizer updates on that rank -- so the shadow costs
4 bytes per parameter / DP instead of 4 on every rank, and a fold reads the owned slice right after the
optimizer wrote it (no parameter gather first, under ``overlap_param_gather`` either).

The whole shadow exists only while something reads or loads it (a preview, a checkpoint):
:meth:`ShadowShards.gather_into` fills a module's parameters from every rank's shards, one bucket at a
time; :meth:`ShadowShards.scatter_from` takes this rank's slices of a loaded one. Checkpoints hold the
whole tensors under the same keys as a replicated shadow's, so they load into any layout.

With ``trainer.ema_offload`` the shards live in host memory (``on_host``): each rank's host keeps and
folds 4 bytes per parameter / DP instead of a whole shadow per GPU (a node of 8 GPUs: 8x less host
memory and fold time); a gather runs on the weights' device a bucket at a time (NCCL gathers no host
tensors)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(eq=False)
class _BucketShard:
    """This rank's shard of one bucket of a DDP parameter buffer."""

    owned: torch.Tensor
    """The model weights of the shard: a view of the bucket's ``param_data`` (the model's dtype)."""
    shard: torch.Tensor
    """Their EMA, fp32."""
    start: int
    """Where the shard begins in the bucket."""
    group: dist.ProcessGroup
    params: list[tuple[int, int, int]] = field(default_factory=list)
    """Shadow parameters whose weights lie in the bucket (their index in ``shadow.parameters()``), with
    their ``[start, end)`` in it."""


def _buckets(ddp_chunks):
    """``(buffer, bucket)`` for every bucket of ``ddp_chunks`` (dense and expert-parallel buffers)."""
    for chunk in ddp_chunks:
        for buffer in (*chunk.buffers, *chunk.expert_parallel_buffers):
            for bucket in buffer.buckets:
                yield buffer, bucket


def unshardable(model: torch.nn.Module) -> str | None:
    """Why the EMA of ``model`` cannot be kept as buffer shards, or None: every parameter must be trained
    (in a gradient bucket) and the model hold no buffers (which only a whole shadow would keep)."""
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        return f"{len(frozen)} parameters are frozen (e.g. {frozen[0]}), outside megatron DDP's buffers"
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        return f"the model holds buffers (e.g. {buffers[0]}), which only a whole shadow keeps"
    return None


class ShadowShards:
    """The fp32 EMA of this rank's shards of ``ddp_chunks``' parameter buffers, for ``shadow`` (a module
    of the same architecture as ``model``, parameter for parameter, unallocated: :meth:`gather_into`
    and :meth:`scatter_from` take its parameters allocated, as a list)."""

    def __init__(self, ddp_chunks, model: torch.nn.Module, shadow: torch.nn.Module, on_host: bool = False):
        reason = unshardable(model) or (
            "megatron DDP keeps no parameter buffer without the distributed optimizer"
            if any(bucket.param_data is None for _, bucket in _buckets(ddp_chunks)) else None)
        if reason is not None:
            raise ValueError(f"trainer.ema_shard=True: {reason}; set trainer.ema_shard=False")
        of_model = {id(p): i for i, (p, _) in enumerate(zip(model.parameters(), shadow.parameters(), strict=True))}
        self.pieces: list[_BucketShard] = []
        for buffer, bucket in _buckets(ddp_chunks):
            group = buffer.data_parallel_group
            size = bucket.param_data.numel() // group.size()
            start = group.rank() * size
            owned = bucket.param_data[start:start + size]
            shard = owned.detach().to("cpu" if on_host else owned.device, torch.float32, copy=True)
            piece = _BucketShard(owned, shard, start, group)
            for p in bucket.params_list:  # (where the buffer put it: aligned starts, not the list's order)
                lo, hi, _ = buffer.param_index_map[p]
                piece.params.append((of_model.pop(id(p)), lo - bucket.offset, hi - bucket.offset))
            self.pieces.append(piece)
        assert not of_model, f"{len(of_model)} parameters in no DDP bucket"

    @property
    def shards(self) -> list[torch.Tensor]:
        return [piece.shard for piece in self.pieces]

    @property
    def owned(self) -> list[torch.Tensor]:
        return [piece.owned for piece in self.pieces]

    @torch.no_grad()
    def restart(self) -> None:
        """The EMA set to the model's current weights."""
        for piece in self.pieces:
            piece.shard.copy_(piece.owned)

    def written_here(self) -> set[int]:
        """Indices of the shadow parameters whose bucket's group this rank leads (data-parallel rank 0,
        for experts expert-data-parallel rank 0): the ranks megatron's checkpoints write them from."""
        return {i for piece in self.pieces if piece.group.rank() == 0 for i, _, _ in piece.params}

    def overlapping(self) -> set[int]:
        """Indices of the shadow parameters with elements in this rank's shards (what a load needs)."""
        return {i for piece in self.pieces for i, lo, hi in piece.params
                if lo < piece.start + piece.shard.numel() and hi > piece.start}

    @torch.no_grad()
    def gather_into(self, params: list[torch.Tensor]) -> None:
        """Fill the allocated shadow ``params`` (on any device; meta ones are skipped) with the EMA from
        every rank's shards, gathered a bucket at a time on the weights' device (a collective: every rank
        of each bucket's group calls it)."""
        for piece in self.pieces:
            shard = piece.shard.to(piece.owned.device)  # (host shards: copied for the gather)
            whole = shard.new_empty(shard.numel() * piece.group.size())
            dist.all_gather_into_tensor(whole, shard, group=piece.group)
            wanted = [(params[i], lo, hi) for i, lo, hi in piece.params if not params[i].is_meta]
            if wanted:  # (one copy per bucket to the parameters' device, e.g. the host for a save)
                whole = whole.to(wanted[0][0].device)
            for param, lo, hi in wanted:
                param.copy_(whole[lo:hi].view(param.shape))

    @torch.no_grad()
    def scatter_from(self, params: list[torch.Tensor]) -> None:
        """Take this rank's slices of the EMA from the shadow's ``params`` (loaded: at least those
        :meth:`overlapping` this rank's shards)."""
        for piece in self.pieces:
            end = piece.start + piece.shard.numel()
            for i, lo, hi in piece.params:
                a, b = max(lo, piece.start), min(hi, end)
                if a < b:
                    piece.shard[a - piece.start:b - piece.start].copy_(params[i].reshape(-1)[a - lo:b - lo])


def _rebind(module: torch.nn.Module, make) -> None:
    """Give every parameter of ``module`` new data ``make(index, param)`` (``index`` in
    ``module.parameters()``) as a new Parameter object, its attributes (megatron's tensor-parallel
    marks) kept: a meta tensor cannot become a parameter's data in place, and whatever still holds the
    old tensors keeps them. A parameter registered twice stays one."""
    index = {id(p): i for i, p in enumerate(module.parameters())}
    new_of: dict[int, torch.nn.Parameter] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                if id(p) not in new_of:
                    new_of[id(p)] = torch.nn.Parameter(make(index[id(p)], p), requires_grad=p.requires_grad)
                    new_of[id(p)].__dict__.update(p.__dict__)
                m._parameters[name] = new_of[id(p)]


@contextlib.contextmanager
def allocated(module: torch.nn.Module, device: torch.device, only: set[int] | None = None):
    """``module``'s parameters allocated (uninitialised) on ``device`` for the ``with`` block -- with
    ``only``, those of these indices, the others left on the meta device --, yielded in order; back on
    the meta device (no memory) after it."""
    _rebind(module, lambda i, p: torch.empty(p.shape, dtype=p.dtype,
                                             device=device if only is None or i in only else "meta"))
    try:
        yield list(module.parameters())
    finally:
        release(module)


def release(module: torch.nn.Module) -> None:
    """``module``'s parameters back on the meta device (no memory)."""
    _rebind(module, lambda i, p: torch.empty(p.shape, dtype=p.dtype, device="meta"))
