"""This rank's model of a layout: from a model folder and a `ParallelDims`, the rank's model (or pipeline stage) with
LoRA, activation checkpointing, transformers' TP / EP plans, FSDP2 and context parallelism applied, and the named
groups its reductions use (torchtitan's `parallelize`, in the order it applies them).

    dims = ParallelDims.for_model(world, config.get_text_config(), seq_len=T, pp=2, ep=2)
    rank = parallelize(folder, dims, lora=lora_config(config, 8), micro_batch=1, micro_batches=4, seq_len=T)
    loss = train_step(rank, batch)        # kimi_hf.distributed.train_step: forward + backward of this rank's share

Which engine shards what (docs/parallelism.md):
- pp > 1: this rank's stage (`load_pipeline_stage`: only its tensors are read), its experts over ep of the stage's data
  ranks, or the stage tensor-parallel over its tp ranks, as transformers loads it; LoRA; FSDP2 over the stage's data
  ranks (`shard_stage`); torch's 1F1B (or GPipe) schedule over mesh["pp"];
- pp == 1 with tp or ep > 1: transformers' DistributedConfig(tp, ep, fsdp, dp_replicate) at load (its own mesh);
  LoRA after it (PEFT shards colwise / rowwise adapters as DTensors; `average_unsharded_grads` reduces them);
- otherwise: the whole model, LoRA, FSDP2 over the data ranks (each decoder layer, then the root).
Then context parallelism over every cp consecutive data ranks (`enable_context_parallel`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from ..models.kimi_hybrid.pipeline_kimi_hybrid import _top  # the model under PEFT's wrapper
from .parallel_dims import ParallelDims


# the language models this trains (Kimi K3 with or without its tower, Kimi Linear)
MODEL_TYPES = ("kimi_k3", "kimi_k3_text", "kimi_hybrid", "kimi_hybrid_text")


@dataclass
class ParallelModel:
    """One rank's part of a parallel job (what `parallelize` returns).

    model: the rank's model, PEFT-wrapped under LoRA (under pp: a stage's, holding its layers only); module: what
    runs forward (the FSDP2-sharded root or the stage's module); stage / schedule: the pipeline's (None without pp);
    groups: "replica" (the ranks holding this rank's layers: QK-Clip's maxima, expert loads, Newton-Schulz work; None:
    the world), "context" (the cp group, None without cp), "adapters" (the ranks PEFT adapters no engine manages are
    averaged over; None: the world), "pipeline" (None without pp); data_rank: this rank's index among the data ranks
    (dp_replicate x fsdp, what a batch is split over, cp consecutive ones sharing a batch); tp_rank: its index in its
    tensor-parallel group; sync_adapters: whether `train_step` averages the adapters' gradients itself."""

    dims: ParallelDims
    config: object
    model: nn.Module
    module: nn.Module
    device: torch.device
    lora: bool
    stage: object | None = None
    schedule: object | None = None
    mesh: object | None = None
    groups: dict = field(default_factory=dict)
    data_rank: int = 0
    tp_rank: int = 0
    sync_adapters: bool = False
    loss_fn: object | None = None  # the pipeline schedule's CausalLMLoss (train_step sets its num_items a step)
    micro_batch: int = 1
    micro_batches: int = 1


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device): torchrun / accelerate launch set WORLD_SIZE (NCCL on CUDA, gloo on CPU); one
    process otherwise."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else None
    if world > 1 and not dist.is_initialized():
        if device is not None:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device is not None else "gloo")
    return (dist.get_rank() if world > 1 else 0), world, device or torch.device("cpu")


def read_config(folder: str):
    """The transformers config of a model folder, read by kimi_hf's registered classes (never the folder's own copy
    of the code, without a prompt)."""
    from transformers import AutoConfig

    import kimi_hf

    kimi_hf.KimiK3Config  # noqa: B018  (getting a class registers the Auto classes: lazily in `kimi-hf`'s process)
    return AutoConfig.from_pretrained(folder, trust_remote_code=False)


def model_class(config):
    """The Auto class a folder of `config` loads with: the multimodal one when it has a vision tower."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM


def load_kwargs(config, dtype: torch.dtype, lora: bool) -> dict:
    """from_pretrained's keywords: the dtype; Kimi K3 under LoRA keeps the released MXFP4 experts resident (frozen
    bytes), full fine-tuning trains them dense. The folder's own copy of the modeling code is never run (a saved
    folder carries it for the Hub): kimi_hf's registered classes load it, without a prompt."""
    kwargs = {"dtype": dtype, "trust_remote_code": False}
    if config.model_type.startswith("kimi_k3"):
        kwargs["experts_format"] = "auto" if lora else "dense"
    return kwargs


def _prepare(model, config, lora, seed: int, gradient_checkpointing: bool):
    """The job's loss chunking on the loaded model's config, LoRA (initialised by name: the same adapters on every
    layout), activation checkpointing, training mode: before FSDP2 shards the model."""
    model.config.get_text_config().loss_chunk_size = config.get_text_config().loss_chunk_size
    if lora is not None:
        from peft import get_peft_model

        from .lora import init_lora_by_name

        model = get_peft_model(model, lora)
        init_lora_by_name(model, seed)
    if gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def parallelize(
    folder: str,
    dims: ParallelDims,
    *,
    config=None,
    lora=None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    gradient_checkpointing: bool = False,
    micro_batch: int = 1,
    micro_batches: int = 1,
    seq_len: int | None = None,
    schedule: str = "1f1b",
    loss_chunk_size: int | None = None,
    device: torch.device | None = None,
) -> ParallelModel:
    """This rank's ParallelModel of the model in `folder` on `dims` (checked: `ParallelDims.for_model`). lora: a
    `peft.LoraConfig` (`kimi_hf.lora_config(config, r)`), or None for full fine-tuning. micro_batch / micro_batches
    (the step's global batch, over all data ranks) / seq_len size the pipeline schedule. loss_chunk_size: the head
    and the loss computed that many tokens at a time, the logits never whole (the text config's `loss_chunk_size`;
    None: the config's). The process group must be up on more than one rank (`init_distributed`)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if dims.world != world:
        raise ValueError(f"dims: a layout of {dims.world} ranks, but the world size is {world}")
    if config is None:
        config = read_config(folder)
    if config.model_type not in MODEL_TYPES:
        raise ValueError(f"{folder}: model_type {config.model_type!r} is not one this trainer runs ({MODEL_TYPES})")
    device = device if device is not None else torch.device("cpu")
    if loss_chunk_size is not None:
        from ..ops.chunked_cross_entropy import check_chunk_size

        check_chunk_size(loss_chunk_size, "loss_chunk_size")  # (assigning the config's field checks nothing)
        config.get_text_config().loss_chunk_size = loss_chunk_size
    rank = ParallelModel(
        dims, config, None, None, device, lora is not None, micro_batch=micro_batch, micro_batches=micro_batches
    )
    if dims.pp > 1 or dims.tp == dims.ep == 1:
        _fsdp_or_pipeline(rank, folder, lora, seed, dtype, gradient_checkpointing, seq_len, schedule)
    else:
        _tensor_parallel(rank, folder, lora, seed, dtype, gradient_checkpointing)
    rank.groups["context"] = None
    if dims.cp > 1:
        from .context import context_parallel_group, enable_context_parallel

        pp_rank = rank.stage.index if rank.stage is not None else 0
        rank.groups["context"] = context_parallel_group(rank.data_rank, dims.cp, rank.tp_rank, pp_rank)
        enable_context_parallel(rank.model, rank.groups["context"])
    return rank


def _fsdp_or_pipeline(rank: ParallelModel, folder, lora, seed, dtype, checkpointing, seq_len, schedule) -> None:
    """pp > 1 (stages on mesh["pp"], each with its experts over ep of its data ranks, or tensor-parallel over its tp
    ranks), or only data parallelism: FSDP2 over the data ranks, after LoRA."""
    from torch.distributed.fsdp import fully_shard

    from .parallel_dims import data_mesh, data_rank
    from .pipeline import (
        CausalLMLoss,
        KimiPipelineStageModule,
        PipelineStageInfo,
        build_schedule,
        decoder_of,
        load_pipeline_stage,
        shard_stage,
    )

    dims, config = rank.dims, rank.config
    cls, kwargs = model_class(config), load_kwargs(config, dtype, lora is not None)
    rank.mesh = dims.build_mesh(rank.device.type) if dims.world > 1 else None
    pp_rank = rank.mesh["pp"].get_local_rank() if rank.mesh is not None else 0
    layers = config.get_text_config().num_hidden_layers
    rank.stage = PipelineStageInfo.split(layers, pp_rank, dims.pp) if dims.pp > 1 else None
    if rank.stage is not None:
        inside = dims.distributed_config() if dims.ep > 1 or dims.tp > 1 else None  # transformers shards the stage
        model = load_pipeline_stage(cls, folder, rank.stage, distributed_config=inside, **kwargs)
    else:
        model = cls.from_pretrained(folder, **kwargs)
    model = _prepare(model.to(rank.device), config, lora, seed, checkpointing)
    rank.model = model
    rank.tp_rank = rank.mesh["tp"].get_local_rank() if rank.mesh is not None else 0
    rank.data_rank = data_rank(rank.mesh) if rank.mesh is not None else 0
    dmesh = data_mesh(rank.mesh) if rank.mesh is not None else None
    # the ranks that hold this rank's layers: a stage's data ranks, or its tensor-parallel ranks (with tp a stage has
    # no data parallelism)
    replica = dmesh.get_group() if dmesh is not None and dmesh.ndim == 1 else None
    if dmesh is not None and dmesh.ndim > 1:
        replica = dmesh._flatten().get_group()
    if dims.tp > 1:
        replica = rank.mesh["tp"].get_group()
    rank.groups.update(replica=replica, adapters=None, pipeline=rank.mesh["pp"].get_group() if dims.pp > 1 else None)
    module = KimiPipelineStageModule(model, rank.stage) if rank.stage is not None else model
    if dmesh is not None and dmesh.size() > 1:
        if rank.stage is not None:
            module = shard_stage(model, rank.stage, dmesh)
        else:
            decoder = decoder_of(model)
            for i in range(layers):
                fully_shard(decoder.layers[i], mesh=dmesh)
            fully_shard(module, mesh=dmesh)
    rank.module = module
    if rank.stage is not None:
        if seq_len is None:
            raise ValueError("seq_len: a pipeline schedule needs the sequence length of its micro-batches")
        # cp: the last stage's targets are its slice of labels shifted before the split
        # with loss_chunk_size the last stage returns its hidden states, and the loss holds the head
        chunk = config.get_text_config().loss_chunk_size if rank.stage.is_last else None
        head = _top(model).lm_head if chunk is not None else None
        rank.loss_fn = CausalLMLoss(
            config.get_text_config().vocab_size,
            grad_divide=dims.data_ranks,
            shifted=dims.cp > 1,
            head=head,
            chunk_size=chunk,
        )
        rank.schedule = build_schedule(
            module,
            rank.stage,
            rank.groups["pipeline"],
            rank.micro_batches // dims.batch_ranks,
            rank.loss_fn,
            schedule,
            micro_batch=rank.micro_batch,
            seq_len=seq_len // dims.cp,
            device=rank.device,
        )


def _tensor_parallel(rank: ParallelModel, folder, lora, seed, dtype, checkpointing) -> None:
    """pp == 1 with tp / ep > 1: transformers' DistributedConfig shards the model as it loads; LoRA after it."""
    dims, config = rank.dims, rank.config
    kwargs = load_kwargs(config, dtype, lora is not None)
    model = model_class(config).from_pretrained(folder, distributed_config=dims.distributed_config(), **kwargs)
    model = _prepare(model, config, lora, seed, checkpointing)
    rank.model = rank.module = model
    manager = model.get_base_model()._mesh_manager if lora is not None else model._mesh_manager
    fsdp, replicate = manager.get_mesh("fsdp"), manager.get_mesh("dp_replicate")
    rank.data_rank = replicate.get_local_rank() * fsdp.size() + fsdp.get_local_rank()
    rank.tp_rank = manager.get_mesh("tp").get_local_rank() if dims.tp > 1 else 0
    # PEFT's adapters, added after transformers sharded the model: no engine reduces them. Under tp their gradients
    # are averaged over the data ranks of this rank's tp coordinate; QK-Clip and expert balancing over the world
    # (every rank holds every layer)
    rank.sync_adapters = lora is not None and dims.data_ranks > 1
    adapters = replicate.get_group() if dims.tp > 1 and dims.data_ranks > 1 else None
    rank.groups.update(replica=None, adapters=adapters, pipeline=None)


__all__ = [
    "MODEL_TYPES",
    "ParallelModel",
    "init_distributed",
    "load_kwargs",
    "model_class",
    "parallelize",
    "read_config",
]
