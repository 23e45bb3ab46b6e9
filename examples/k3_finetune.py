"""Fine-tune Kimi K3 (or Kimi Linear) on any layout of ranks: LoRA over the resident MXFP4 experts or full
fine-tuning, MuonClip or AdamW, pipeline stages (Attention Residuals across the boundary), FSDP2, tensor / expert
parallelism, context parallelism (--cp), sharded checkpoints to resume from.

    python examples/k3_finetune.py --model DIR --lora --steps 4 --data random                  # one process
    torchrun --nproc-per-node 4 examples/k3_finetune.py --model DIR --lora --pp 2 --fsdp 2     # 4 ranks
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT examples/k3_finetune.py ...
    accelerate launch --config_file examples/accelerate/cpu_k3_finetune.yaml examples/k3_finetune.py ...

Rank 0 prints one JSON line per optimizer step, {"step": i, "loss": x}, and nothing else on stdout (errors: one
line on stderr, exit status 2; what is refused before the process group starts is printed once: a bad --model folder,
a layout, with the flag that makes it run, the batch, --data, --resume, --export). A step trains on the same global
batch in every layout, --micro-batch sequences of --seq-len tokens times --micro-batches (default 4), split over the
data ranks (dp_replicate x fsdp = world / (pp x tp); with --cp C, every C consecutive data ranks split each sequence
instead: kimi_hf.distributed.context), so the same seed and data give the same losses on any layout (to rounding).
--data random draws seeded token ids below the config's vocab_size (a folder without a tokenizer; the image
placeholder id left out); --data stdlib tokenizes the Python standard library's sources with the folder's tokenizer.
--export DIR writes the trained model in K3's released layout from the last checkpoint, streaming (LoRA: merged into
the source folder's weights); an existing DIR is refused before training starts unless --overwrite is given (it is
then replaced once the new folder is complete).

--checkpoint-dir D saves a sharded checkpoint (torch.distributed.checkpoint) at the end (and every --save-every
steps): model (LoRA: the adapters), optimizer states, scheduler, step. --resume continues from D's latest step,
also on another layout (DCP reshards), with the same losses as an uninterrupted run. See docs/parallelism.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Kimi K3 / Kimi Linear model folder (config.json + weights)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--lora", action="store_true", help="LoRA adapters, the base frozen (the default)")
    mode.add_argument("--full", action="store_true", help="full fine-tuning (experts loaded dense)")
    p.add_argument("--optimizer", choices=("muonclip", "adamw"), default="muonclip")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences a micro-batch")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches a step (over all data ranks)")
    p.add_argument("--data", choices=("stdlib", "random"), default="stdlib")
    for name in ("tp", "ep", "pp", "fsdp", "cp"):
        p.add_argument(f"--{name}", type=int, default=1)
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b", help="the pipeline schedule")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--qk-clip-tau", type=float, default=100.0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute each layer in the backward")
    p.add_argument("--checkpoint-dir")
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: at the end only)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir's latest step")
    p.add_argument(
        "--export", metavar="DIR", help="at the end, the trained model in K3's released layout (LoRA: merged)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --export DIR")
    args = p.parse_args(argv)
    args.lora = not args.full
    for name in ("steps", "seq_len", "micro_batch", "micro_batches", "lora_rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.export and not args.checkpoint_dir:
        p.error("--export needs --checkpoint-dir: the export streams the trained weights from the sharded checkpoint")
    return args


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    # refused before the process group starts, alike on every rank: printed once (the folders: once a node)
    try:
        config = check_files(args)
    except (ValueError, TypeError, OSError) as e:
        refuse(e, printer="LOCAL_RANK")
    try:
        layout = check_layout(args, config, int(os.environ.get("WORLD_SIZE", "1")))
    except (ValueError, TypeError, OSError) as e:
        refuse(e, printer="RANK")
    try:
        return run(args, config, layout)
    except (ValueError, TypeError, OSError) as e:
        refuse(e)


PRINTER_GRACE_S = 30  # how long the silent ranks of a refusal wait for the printing one (then exit all the same)


def refuse(error: Exception, printer: str | None = None):
    """One line on stderr, exit status 2. printer: for a refusal that every rank makes alike, the environment
    variable ("RANK", "LOCAL_RANK") whose rank 0 alone prints it; the other ranks first wait (the printing one's exit
    ends them sooner), as torchrun stops every rank once one has failed, the printing one too if it had not printed
    yet."""
    if printer is None or os.environ.get(printer, "0") == "0":
        print(f"k3_finetune: error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
    else:
        import time

        time.sleep(PRINTER_GRACE_S)
    raise SystemExit(2) from None


def check_files(args):
    """The folders, before any expensive work: --model (`kimi_hf.model_folder.check_model_folder`: its config.json
    and every safetensors header against its file's size), its tokenizer for --data stdlib, --checkpoint-dir's steps
    for --resume, the --export folder rank 0 will write (new, or --overwrite). Returns the model's config."""
    from kimi_hf.model_folder import check_model_folder

    check_model_folder(args.model, what="--model", model_types=MODEL_TYPES)
    config = read_config(args.model)
    if args.data == "stdlib" and not any(
        os.path.isfile(os.path.join(args.model, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        raise ValueError(f"--data stdlib needs a tokenizer in --model {args.model}; use --data random")
    if args.resume:
        from kimi_hf.distributed.checkpoint import checkpoint_steps

        if not checkpoint_steps(args.checkpoint_dir):
            raise ValueError(f"--checkpoint-dir {args.checkpoint_dir}: no checkpoint (step-N folder) to resume from")
    if args.export and os.environ.get("RANK", "0") == "0":
        from kimi_hf.distributed.export import check_export_dir

        check_export_dir(args.export, args.model, args.checkpoint_dir, args.overwrite)
    return config


def check_layout(args, config, world: int):
    """The layout of the flags on `world` ranks, refused with the flag that makes it run (`TrainingLayout.check`),
    the sequence over --cp, the batch over the data ranks. Returns the TrainingLayout."""
    from kimi_hf.distributed.mesh import TrainingLayout

    text = config.get_text_config()
    layout = TrainingLayout(tp=args.tp, ep=args.ep, pp=args.pp, fsdp=args.fsdp, cp=args.cp)
    check_context_split(args, text)
    layout.check(world, text)
    check_batch(args, layout, world)
    return layout


# ---- set-up ------------------------------------------------------------------------------------------------------
def init_distributed():
    """(rank, world size, device): torchrun / accelerate launch set WORLD_SIZE; one process otherwise."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else None
    if world > 1 and not dist.is_initialized():
        if device is not None:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device is not None else "gloo")
    return (dist.get_rank() if world > 1 else 0), world, device or torch.device("cpu")


# the language models this trains (Kimi K3 with or without its tower, Kimi Linear)
MODEL_TYPES = ("kimi_k3", "kimi_k3_text", "kimi_hybrid", "kimi_hybrid_text")


def read_config(folder: str):
    """The transformers config of a folder `check_model_folder` accepted."""
    from transformers import AutoConfig

    import kimi_hf  # noqa: F401  (registers the Kimi classes)

    return AutoConfig.from_pretrained(folder)


def model_class(config):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM


def load_kwargs(args, config) -> dict:
    import torch

    kwargs = {"dtype": getattr(torch, args.dtype)}
    if config.model_type.startswith("kimi_k3"):
        # LoRA keeps the released MXFP4 experts resident (frozen bytes); full fine-tuning trains them dense
        kwargs["experts_format"] = "dense" if args.full else "auto"
    return kwargs


def lora_targets(config) -> list[str]:
    from kimi_hf import LORA_TARGET_MODULES
    from kimi_hf.models.kimi_k3.modeling_kimi_k3 import K3_LORA_TARGET_MODULES

    return K3_LORA_TARGET_MODULES if config.model_type.startswith("kimi_k3") else LORA_TARGET_MODULES


def prepare(model, args, config):
    """LoRA (or not), activation checkpointing, training mode: before FSDP2 shards the model."""
    if args.lora:
        model = with_lora(model, args, config)
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def with_lora(model, args, config):
    from peft import LoraConfig, get_peft_model

    from kimi_hf.distributed.lora import init_lora_by_name

    targets = lora_targets(config)
    lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0, target_modules=targets)
    model = get_peft_model(model, lora)
    init_lora_by_name(model, args.seed)  # the same adapters on every layout (a stage holds only some layers)
    return model


# ---- data --------------------------------------------------------------------------------------------------------
class Batches:
    """The global batch of each step: [micro_batches * micro_batch, seq_len] token ids, the same in every layout
    (a function of the seed and the step alone)."""

    def __init__(self, args, config, folder: str):
        self.args, self.vocab = args, config.get_text_config().vocab_size
        self.image_token = getattr(config, "image_token_id", None)
        self.tokens = None
        if args.data == "stdlib":
            self.tokens = self._stdlib_tokens(folder)

    def _stdlib_tokens(self, folder: str):
        import torch
        from transformers import AutoTokenizer

        from kimi_hf.data import stdlib_bytes

        try:
            tok = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"--data stdlib needs a tokenizer in --model {folder} ({e}); use --data random") from None
        need = self.args.steps * self.rows * (self.args.seq_len + 1)
        ids, offset, chunk = [], 0, stdlib_bytes()
        while len(ids) < need and offset < len(chunk):
            ids += tok(chunk[offset : offset + 200_000].decode("utf-8", "ignore"))["input_ids"]
            offset += 200_000
        if len(ids) < need:
            raise ValueError(f"--data stdlib: {len(ids)} tokens, {need} needed for --steps {self.args.steps}")
        return torch.tensor(ids[:need], dtype=torch.long)

    @property
    def rows(self) -> int:
        return self.args.micro_batches * self.args.micro_batch

    def __call__(self, step: int):
        import torch

        T = self.args.seq_len
        if self.tokens is None:
            gen = torch.Generator().manual_seed(self.args.seed * 100_003 + step)
            ids = torch.randint(0, self.vocab, (self.rows, T), generator=gen)
            if self.image_token is not None:  # a text batch: the image placeholder would ask for pixels
                ids[ids == self.image_token] = (self.image_token + 1) % self.vocab
            return ids
        start = step * self.rows * (T + 1)
        return self.tokens[start : start + self.rows * (T + 1)].view(self.rows, T + 1)[:, :T]


# ---- the layouts -------------------------------------------------------------------------------------------------
def check_context_split(args, text_config) -> None:
    """--cp: the sequence must cut into equal slices at least as long as the short convolution's left context."""
    if args.cp == 1:
        return
    from kimi_hf.models.kimi_hybrid.context_kimi_hybrid import check_slice_length

    if args.seq_len % args.cp:
        fix = -(-args.seq_len // args.cp) * args.cp
        raise ValueError(f"--seq-len {args.seq_len} is not divisible by --cp {args.cp}; use --seq-len {fix}")
    try:
        check_slice_length(text_config, args.seq_len // args.cp, f"--seq-len {args.seq_len} over --cp {args.cp}")
    except ValueError as e:
        raise ValueError(f"{e}: --seq-len {args.cp * (text_config.linear_conv_kernel_dim - 1)} or more") from None


def check_batch(args, layout, world: int) -> None:
    """--micro-batches over the ranks that see distinct batches, and the 1F1B schedule's micro-batches a stage."""
    batches = layout.batch_ranks(world)
    local = args.micro_batches // batches
    stages = args.pp if args.pp > 1 and args.schedule == "1f1b" else 1  # micro-batches a rank needs at least
    fix = f"use --micro-batches {max(-(-args.micro_batches // batches), stages) * batches}"
    if args.micro_batches % batches:
        raise ValueError(f"--micro-batches {args.micro_batches} is not divisible by the {batches} data ranks; {fix}")
    if args.pp > 1 and args.schedule == "1f1b" and local < args.pp:
        raise ValueError(
            f"--micro-batches {args.micro_batches} over {batches} data ranks leaves {local} a rank, fewer than the "
            f"--pp {args.pp} stages the 1F1B schedule needs; {fix} (or --schedule gpipe)"
        )


class Job:
    """The model of this rank, how a step runs on it, and the groups the optimizer reduces over."""

    def __init__(self, args, config, layout, rank, world, device):
        """`layout`: checked by `check_layout` on this world size."""
        self.args, self.config, self.rank, self.world, self.device = args, config, rank, world, device
        self.layout = layout
        self.dp = layout.data_ranks(world)  # what FSDP2 / transformers average gradients over
        self.batches = layout.batch_ranks(world)  # distinct batches: a context-parallel group splits one
        self.local_micro = args.micro_batches // self.batches
        if args.pp > 1 or args.tp == args.ep == 1:
            self._build_fsdp_pipeline()
        else:
            self._build_tensor_parallel()
        self.cp_group = None
        if args.cp > 1:
            from kimi_hf.distributed.context import context_parallel_group, enable_context_parallel

            pp_rank = self.stage.index if self.stage is not None else 0
            self.cp_group = context_parallel_group(self.data_rank, args.cp, self.tp_rank, pp_rank)
            enable_context_parallel(self.model, self.cp_group)

    def _build_fsdp_pipeline(self):
        """pp > 1 (stages on mesh["pp"], each with its experts over --ep of its data ranks, or tensor-parallel over
        its --tp ranks), or only data parallelism: FSDP2 over the data ranks, after LoRA."""
        from torch.distributed.fsdp import fully_shard
        from transformers.distributed import DistributedConfig

        from kimi_hf.distributed import (
            CausalLMLoss,
            PipelineStageInfo,
            build_schedule,
            load_pipeline_stage,
            shard_stage,
        )
        from kimi_hf.distributed.mesh import data_mesh, data_rank
        from kimi_hf.distributed.pipeline import KimiPipelineStageModule, decoder_of

        args, config = self.args, self.config
        cls, kwargs = model_class(config), load_kwargs(args, config)
        self.mesh = self.layout.build_mesh(self.device.type, self.world) if self.world > 1 else None
        pp_rank = self.mesh["pp"].get_local_rank() if self.mesh is not None else 0
        layers = config.get_text_config().num_hidden_layers
        self.stage = PipelineStageInfo.split(layers, pp_rank, args.pp) if args.pp > 1 else None
        if self.stage is not None:
            # --ep / --tp: transformers shards each stage over its own ranks as it loads
            inside = None
            if args.ep > 1 or args.tp > 1:
                inside = DistributedConfig(
                    tp_size=args.tp, ep_size=args.ep, fsdp_size=args.fsdp, dp_replicate_size=self.dp // args.fsdp
                )
            model = load_pipeline_stage(cls, args.model, self.stage, distributed_config=inside, **kwargs)
        else:
            model = cls.from_pretrained(args.model, **kwargs)
        model = prepare(model.to(self.device), args, config)
        self.model, self.sync_adapters = model, False
        self.tp_rank = self.mesh["tp"].get_local_rank() if self.mesh is not None else 0
        self.data_rank = data_rank(self.mesh) if self.mesh is not None else 0
        dmesh = data_mesh(self.mesh) if self.mesh is not None else None
        # the ranks that hold this rank's layers (QK-Clip's maxima, expert loads, Newton-Schulz work): a stage's data
        # ranks, or its tensor-parallel ranks (with --tp a stage has no data parallelism)
        self.replica_group = dmesh.get_group() if dmesh is not None and dmesh.ndim == 1 else None
        if dmesh is not None and dmesh.ndim > 1:
            self.replica_group = dmesh._flatten().get_group()
        if args.tp > 1:
            self.replica_group = self.mesh["tp"].get_group()
        module = KimiPipelineStageModule(model, self.stage) if self.stage is not None else model
        if dmesh is not None and dmesh.size() > 1:
            if self.stage is not None:
                module = shard_stage(model, self.stage, dmesh)
            else:
                decoder = decoder_of(model)
                for i in range(layers):
                    fully_shard(decoder.layers[i], mesh=dmesh)
                fully_shard(module, mesh=dmesh)
        # --cp: the last stage's targets are its slice of labels shifted before the split
        self.loss_fn = CausalLMLoss(config.get_text_config().vocab_size, grad_divide=self.dp, shifted=args.cp > 1)
        self.schedule = None
        if self.stage is not None:
            self.schedule = build_schedule(
                module,
                self.stage,
                self.mesh["pp"].get_group(),
                self.local_micro,
                self.loss_fn,
                args.schedule,
                micro_batch=args.micro_batch,
                seq_len=args.seq_len // args.cp,
                device=self.device,
            )

    def _build_tensor_parallel(self):
        """pp == 1 with tp / ep > 1: transformers' DistributedConfig shards the model as it loads."""
        from transformers.distributed import DistributedConfig

        from kimi_hf.distributed import CausalLMLoss

        args, config = self.args, self.config
        replicate = self.world // (args.tp * args.fsdp)
        dc = DistributedConfig(tp_size=args.tp, ep_size=args.ep, fsdp_size=args.fsdp, dp_replicate_size=replicate)
        model = model_class(config).from_pretrained(args.model, distributed_config=dc, **load_kwargs(args, config))
        model = prepare(model, args, config)
        self.model, self.stage, self.schedule = model, None, None
        manager = model.get_base_model()._mesh_manager if args.lora else model._mesh_manager
        fsdp, rep = manager.get_mesh("fsdp"), manager.get_mesh("dp_replicate")
        self.data_rank = rep.get_local_rank() * fsdp.size() + fsdp.get_local_rank()
        self.tp_rank = manager.get_mesh("tp").get_local_rank() if args.tp > 1 else 0
        self.replica_group = None  # QK-Clip / expert balancing over the world: every rank holds every layer
        self.sync_adapters = args.lora and self.dp > 1
        # the adapters' gradients are averaged over the data ranks: under --tp, the ranks of this rank's tp coordinate
        self.adapter_group = rep.get_group() if args.tp > 1 and self.dp > 1 else None
        self.loss_fn = CausalLMLoss(config.get_text_config().vocab_size, grad_divide=self.dp)
        self.mesh = None

    # ---- one step -----------------------------------------------------------------------------------------------
    def step(self, x) -> "torch.Tensor":  # noqa: F821
        """Forward and backward of this rank's share of the global batch x; returns this rank's summed loss part
        (the step's mean loss is the sum over the data ranks, over the last stage's ranks under pp)."""
        import torch

        from kimi_hf.distributed.lora import average_unsharded_grads

        args = self.args
        self.loss_fn.num_items = x[:, 1:].numel()
        rows, batch = x.shape[0] // self.batches, self.data_rank // args.cp
        local = x[batch * rows : (batch + 1) * rows]
        if self.schedule is not None:
            losses, inputs, target = [], local, local
            if self.cp_group is not None:  # this rank's slice of each sequence, the labels shifted before the cut
                from kimi_hf.distributed.context import context_parallel_batch

                part = context_parallel_batch(local, self.cp_group)
                inputs, target = part["input_ids"], part["shift_labels"]
            if self.stage.is_first:
                self.schedule.step(inputs)
            elif self.stage.is_last:
                self.schedule.step(target=target, losses=losses)
            else:
                self.schedule.step()
            if not self.stage.is_last:
                return torch.zeros((), device=self.device)
            # (the --tp ranks of the last stage computed the same loss)
            return torch.stack([loss.detach() for loss in losses]).sum() / (self.dp * args.tp)
        total = torch.zeros((), device=self.device)
        for mb in local.split(args.micro_batch):
            mb = mb.to(self.device)
            inputs, labels, shifted = {"input_ids": mb}, mb, None
            if self.cp_group is not None:  # this rank's slice of each sequence, its labels shifted before the cut
                from kimi_hf.distributed.context import context_parallel_batch

                part = context_parallel_batch(mb, self.cp_group)
                inputs, labels, shifted = (
                    {k: part[k] for k in ("input_ids", "position_ids")},
                    None,
                    part["shift_labels"],
                )
            logits = self.model(**inputs, use_cache=False).logits
            loss = self.loss_fn(logits, labels, shifted)
            loss.backward()
            total += loss.detach() / self.dp
        if self.sync_adapters:  # PEFT's adapters, added after transformers sharded the model: no engine reduces them
            average_unsharded_grads(self.model, self.adapter_group)
        return total / self.args.tp  # the tp ranks of a data rank computed the same loss


def optimizer_and_scheduler(job: Job):
    import torch

    from kimi_hf.optim import MuonClip

    args, model = job.args, job.model
    if args.optimizer == "muonclip":
        opt = MuonClip.from_model(model, lr=args.lr, qk_clip_tau=args.qk_clip_tau, process_group=job.replica_group)
    else:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.1)
    # a linear warm-up over the first 2 steps that already moves at step 0 (lr / 2, then lr)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))


def run(args, config, layout) -> list[float]:
    """Trains (and saves, exports) on this rank: `config` and `layout` as `check_files` / `check_layout` checked."""
    import torch
    import torch.distributed as dist

    from kimi_hf.distributed.checkpoint import TrainState, load_checkpoint, save_checkpoint
    from kimi_hf.optim import track_expert_load, update_expert_bias

    rank, world, device = init_distributed()
    torch.manual_seed(args.seed)
    job = Job(args, config, layout, rank, world, device)
    opt, scheduler = optimizer_and_scheduler(job)
    batches = Batches(args, config, args.model)
    balance = args.full  # LoRA keeps the base model's expert biases
    if balance:
        track_expert_load(job.model)
    state = TrainState(job.model, opt, scheduler, trainable_only=args.lora)
    start = load_checkpoint(args.checkpoint_dir, state) if args.resume else 0
    losses = []
    for step in range(start, args.steps):
        loss = job.step(batches(step))
        opt.step()
        scheduler.step()
        opt.zero_grad(set_to_none=True)
        if balance:
            update_expert_bias(job.model, update_rate=1e-3, group=job.replica_group)
        if world > 1:
            dist.all_reduce(loss)  # the data ranks' (and, under pp, the last stage's) shares of the mean
        losses.append(loss.item())
        if rank == 0:
            print(json.dumps({"step": step, "loss": losses[-1]}), flush=True)
        done = step + 1
        if args.checkpoint_dir and (done == args.steps or (args.save_every and done % args.save_every == 0)):
            # (--export reads the last one)
            save_checkpoint(args.checkpoint_dir, state, done)
    if args.export:
        export(args, config, rank, world)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return losses


def export(args, config, rank: int, world: int) -> None:
    """Rank 0 writes the official K3 layout from the last saved step, streaming (a layer or a source shard at a
    time); the other ranks wait."""
    import torch.distributed as dist

    from kimi_hf.distributed.checkpoint import checkpoint_steps
    from kimi_hf.distributed.export import export_full, export_lora

    if rank == 0:
        step_dir = os.path.join(args.checkpoint_dir, f"step-{checkpoint_steps(args.checkpoint_dir)[-1]}")
        if args.lora:
            export_lora(step_dir, args.model, args.export, scaling=2.0, overwrite=args.overwrite)  # lora_alpha = 2 r
        else:
            export_full(step_dir, args.model, args.export, overwrite=args.overwrite)
    if world > 1:
        dist.barrier()


if __name__ == "__main__":
    main()
