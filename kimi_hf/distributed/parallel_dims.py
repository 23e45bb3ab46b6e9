"""The parallel layout of a job: one object with every size, its rules stated once, the meshes built from it
(torchtitan's `ParallelDims`). `kimi-hf plan`, the trainer, the pipeline-stage loader and the tests all read it.

    dims = ParallelDims.for_model(16, text_config, ep=8)     # fsdp left out: the data ranks the other sizes leave;
                                                              # ValueError naming the size and the flag that fixes it
    dims.describe()  # 'pp 1 x dp_replicate 1 x fsdp 16 x tp 1 = 16 ranks; ep 8 (tiles tp x fsdp), cp 1'
    mesh = dims.build_mesh("cuda")                            # DeviceMesh ("pp", "dp_replicate", "fsdp", "tp")

The sizes multiply to the world: world = pp x dp_replicate x fsdp x tp. The other two tile those ranks:
- ep: the routed experts' ranks tile tp x fsdp (transformers' 2-D expert mesh): ep is a multiple of tp and divides
  tp x fsdp; each expert-parallel group then shards its experts over the rest of the data ranks (FSDP2);
- cp: every cp consecutive data ranks (dp_replicate x fsdp) split one batch's sequences (kimi_hf.distributed.context);
  the engines see them as data ranks (their gradients are reduced with the others').

What runs on which mesh (docs/parallelism.md):
- pp > 1: each stage's rank group is mesh["pp"]; a stage is fully sharded over ("dp_replicate", "fsdp") (HSDP when
  both are > 1) with torch's fully_shard (kimi_hf.distributed.pipeline.shard_stage); with ep > 1 transformers'
  expert parallelism shards the stage's experts over ep of its data ranks as it loads (load_pipeline_stage); with
  tp > 1 transformers' tensor (and expert) parallelism shard the stage over its ranks, which then are all tensor-
  parallel (world = pp x tp).
- pp == 1: tensor / expert parallelism are transformers' (DistributedConfig(tp_size, ep_size, ...)), on its own
  mesh; without them the model is fully sharded over ("dp_replicate", "fsdp").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..mx_block import MX_BLOCK


SIZES = ("pp", "dp_replicate", "fsdp", "tp", "ep", "cp")  # the flags, as `--name N`


class _NamesItsFix(ValueError):
    """A refusal whose message already says the fix (another --seq-len): no layout flag is appended to it."""


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"--{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ParallelDims:
    """Every size of a layout over `world` ranks (each >= 1): world = pp x dp_replicate x fsdp x tp; ep tiles
    tp x fsdp, cp splits the data ranks' sequences. Build it with `resolve` (which fills the sizes left out), then
    `check` it against a model's config."""

    world: int
    tp: int = 1
    ep: int = 1
    pp: int = 1
    fsdp: int = 1
    cp: int = 1
    dp_replicate: int = 1

    @classmethod
    def resolve(
        cls,
        world: int,
        *,
        tp: int = 1,
        ep: int = 1,
        pp: int = 1,
        cp: int = 1,
        fsdp: int | None = None,
        dp_replicate: int | None = None,
    ) -> "ParallelDims":
        """The layout of the given sizes on `world` ranks. `fsdp` left out (None, or -1 as torchtitan writes it) is
        the data ranks the other sizes leave: world / (pp x tp x dp_replicate); under tp > 1 (tensor parallelism runs
        without FSDP in this version) it is 1 and the rest replicates. `dp_replicate` left out is what fsdp leaves.
        ValueError (naming the flag) for sizes that are not positive or do not divide the world."""
        _positive("world size", world)
        for name, value in (("tp", tp), ("ep", ep), ("pp", pp), ("cp", cp)):
            _positive(name, value)
        fsdp = None if fsdp == -1 else fsdp
        for name, value in (("fsdp", fsdp), ("dp_replicate", dp_replicate)):
            if value is not None:
                _positive(name, value)
        if world % (pp * tp):
            raise ValueError(f"--pp {pp} x --tp {tp} = {pp * tp} does not divide the world size {world}")
        data = world // (pp * tp)  # the data ranks: dp_replicate x fsdp
        if fsdp is None:
            replicate = 1 if dp_replicate is None else dp_replicate
            if data % replicate:
                raise ValueError(f"--dp-replicate {replicate} does not divide the {data} data ranks")
            fsdp = 1 if tp > 1 and dp_replicate is None else data // replicate
        if data % fsdp:
            raise ValueError(
                f"--fsdp {fsdp} does not divide the {data} data ranks (world size {world} / (pp {pp} x tp {tp}))"
            )
        if dp_replicate is None:
            dp_replicate = data // fsdp
        if dp_replicate * fsdp != data:
            raise ValueError(
                f"--dp-replicate {dp_replicate} x --fsdp {fsdp} = {dp_replicate * fsdp}, but the world size {world} "
                f"leaves {data} data ranks (world / (pp {pp} x tp {tp}))"
            )
        return cls(world=world, tp=tp, ep=ep, pp=pp, fsdp=fsdp, cp=cp, dp_replicate=dp_replicate)

    # ---- sizes ----------------------------------------------------------------------------------------------------
    @property
    def data_ranks(self) -> int:
        """The data ranks of the parallelism engines (FSDP2 / transformers average gradients over them):
        dp_replicate x fsdp = world / (pp x tp)."""
        return self.dp_replicate * self.fsdp

    @property
    def batch_ranks(self) -> int:
        """How many ranks see distinct batches: the data ranks over cp (a context-parallel group splits one)."""
        return self.data_ranks // self.cp

    @property
    def replica(self) -> int:
        """The ranks one copy of the model spans: tp x pp x fsdp."""
        return self.tp * self.pp * self.fsdp

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def describe(self) -> str:
        """The layout with sizes that multiply to the world, and the two that tile them."""
        return (
            f"pp {self.pp} x dp_replicate {self.dp_replicate} x fsdp {self.fsdp} x tp {self.tp} = {self.world} ranks; "
            f"ep {self.ep} (tiles tp x fsdp), cp {self.cp}"
        )

    def flags(self) -> list[str]:
        """The trainer's flags of this layout: sizes of 1 left out, and --fsdp only when it is not what the others
        leave (`resolve` without it gives another layout)."""
        out = []
        for name in ("tp", "ep", "pp", "cp"):
            if getattr(self, name) > 1:
                out += [f"--{name}", str(getattr(self, name))]
        if ParallelDims.resolve(self.world, tp=self.tp, ep=self.ep, pp=self.pp, cp=self.cp) != self:
            out += ["--fsdp", str(self.fsdp)]
        return out

    # ---- rules ----------------------------------------------------------------------------------------------------
    @classmethod
    def for_model(cls, world: int, text_config, *, seq_len: int | None = None, **sizes) -> "ParallelDims":
        """`resolve(world, **sizes)` then the rules for the model (text_config: a KimiHybridTextConfig or Kimi K3's)
        and, with `seq_len`, the context-parallel split of a sequence: the layout of a job's flags, refused (a
        ValueError naming the size) with the one flag that makes it run where there is one (`suggest_fix`)."""
        try:
            pp, layers = sizes.get("pp", 1), text_config.num_hidden_layers
            if isinstance(pp, int) and pp > layers:  # said before the sizes' arithmetic: the cause, not a symptom
                raise ValueError(
                    f"--pp {pp} leaves a pipeline stage without layers: the model has {layers} decoder layers"
                )
            dims = cls.resolve(world, **sizes)
            dims._check(text_config, seq_len)
        except _NamesItsFix as e:
            raise ValueError(str(e)) from None
        except ValueError as e:
            fix = suggest_fix(world, sizes, text_config, seq_len)
            raise ValueError(f"{e}; {fix}" if fix else str(e)) from None
        return dims

    def check(self, text_config, seq_len: int | None = None) -> "ParallelDims":
        """`for_model` of these sizes: ValueError for a layout that cannot run the model or that this package does
        not run yet, naming the size and the flag that fixes it. Returns self."""
        sizes = {n: getattr(self, n) for n in ("tp", "ep", "pp", "cp", "fsdp", "dp_replicate")}
        return ParallelDims.for_model(self.world, text_config, seq_len=seq_len, **sizes)

    def _check(self, text_config, seq_len: int | None) -> None:
        for name in ("world", *SIZES):
            _positive(name if name != "world" else "world size", getattr(self, name))
        tp, pp, fsdp = self.tp, self.pp, self.fsdp
        if self.pp * self.dp_replicate * self.fsdp * self.tp != self.world:
            raise ValueError(
                f"--pp {pp} x --dp-replicate {self.dp_replicate} x --fsdp {fsdp} x --tp {tp} = "
                f"{pp * self.dp_replicate * fsdp * tp} ranks, but the world size is {self.world}"
            )
        if tp > 1 and fsdp > 1:
            raise ValueError(
                f"--tp {tp} with --fsdp {fsdp}: transformers 5.24's loader cannot cut tensors with a size-1 first dim "
                "(K3's Attention Residual queries, stored [1, d]) over a 2-D mesh; use --tp with --ep (the other data "
                "ranks replicate), or --fsdp (with --ep / --pp)"
            )
        if pp > 1 and tp > 1 and self.world != pp * tp:
            raise ValueError(
                f"--pp {pp} with --tp {tp} on {self.world} ranks: tensor parallelism inside a pipeline stage runs "
                f"without data parallelism in this version (the world size must be pp x tp = {pp * tp})"
            )
        layers = text_config.num_hidden_layers
        if pp > layers:
            raise ValueError(
                f"--pp {pp} leaves a pipeline stage without layers: the model has {layers} decoder layers"
            )
        heads = [("num_attention_heads", text_config.num_attention_heads, "full_attention")]
        heads.append(
            ("linear_attn_config.num_heads", getattr(text_config, "linear_num_heads", None), "linear_attention")
        )
        for field, count, kind in heads:
            if count and kind in text_config.layer_types and count % tp:
                raise ValueError(f"--tp {tp} does not divide {field} ({count}): tensor parallelism shards by head")
        self._check_experts(text_config)
        if seq_len is not None and self.cp > 1:
            self._check_context_split(text_config, seq_len)
        if self.data_ranks % self.cp:
            raise ValueError(
                f"--cp {self.cp} does not divide the {self.data_ranks} data ranks (world size {self.world} / "
                "(pp x tp)): each batch is split over --cp data ranks"
            )

    def _check_experts(self, text_config) -> None:
        from ..models.kimi_k3.configuration_kimi_k3 import experts_are_mxfp4

        tp, ep, fsdp = self.tp, self.ep, self.fsdp
        experts = text_config.num_experts if "sparse" in text_config.mlp_layer_types else 0
        if not experts:
            if ep > 1:
                raise ValueError(f"--ep {ep}: this model has no routed experts")
            return
        if experts % ep:
            raise ValueError(
                f"--ep {ep} does not divide num_experts ({experts}): expert parallelism splits whole experts"
            )
        if ep > 1 and (ep % tp or (tp * fsdp) % ep):
            raise ValueError(
                f"--ep {ep} must be a multiple of --tp {tp} and divide --tp x --fsdp ({tp * fsdp}): the experts' "
                "ranks tile the same devices as the dense weights' (transformers' 2-D expert mesh)"
            )
        inter = text_config.moe_intermediate_size
        if ep == 1 and inter % tp:
            raise ValueError(f"--tp {tp} does not divide moe_intermediate_size ({inter})")
        # experts stored in MXFP4 are cut by tp before they are decoded (resident or dense in memory alike)
        if ep == 1 and experts_are_mxfp4(text_config) and (inter // tp) % MX_BLOCK:
            raise ValueError(
                f"--tp {tp} splits the MXFP4 experts' moe_intermediate_size ({inter}) into {inter // tp} inputs a rank, "
                f"not whole {MX_BLOCK}-value blocks: use --ep, or a smaller --tp"
            )

    def _check_context_split(self, text_config, seq_len: int) -> None:
        """Each of the cp ranks holds seq_len / cp consecutive tokens of every sequence, at least the short
        convolution's left context (which a slice takes from the rank before)."""
        from ..models.kimi_hybrid.context_kimi_hybrid import check_slice_length

        cp = self.cp
        if seq_len % cp:
            raise _NamesItsFix(
                f"--seq-len {seq_len} is not divisible by --cp {cp}; use --seq-len {-(-seq_len // cp) * cp}"
            )
        try:
            check_slice_length(text_config, seq_len // cp, f"--seq-len {seq_len} over --cp {cp}")
        except ValueError as e:
            raise _NamesItsFix(f"{e}: --seq-len {cp * (text_config.linear_conv_kernel_dim - 1)} or more") from None

    def check_batch(self, micro_batches: int, schedule: str = "1f1b") -> None:
        """--micro-batches (a step's global batch, in micro-batches) over the ranks that see distinct batches, and
        the 1F1B schedule's micro-batches a stage. ValueError naming the fix."""
        batches = self.batch_ranks
        local = micro_batches // batches
        stages = self.pp if self.pp > 1 and schedule == "1f1b" else 1  # micro-batches a rank needs at least
        fix = f"use --micro-batches {max(-(-micro_batches // batches), stages) * batches}"
        if micro_batches % batches:
            raise ValueError(f"--micro-batches {micro_batches} is not divisible by the {batches} data ranks; {fix}")
        if local < stages:
            raise ValueError(
                f"--micro-batches {micro_batches} over {batches} data ranks leaves {local} a rank, fewer than the "
                f"--pp {self.pp} stages the 1F1B schedule needs; {fix} (or --schedule gpipe)"
            )

    # ---- meshes ---------------------------------------------------------------------------------------------------
    def build_mesh(self, device_type: str):
        """DeviceMesh ("pp", "dp_replicate", "fsdp", "tp") over the world: the dimensions of transformers' dense
        mesh, in its order, so that the ranks of a stage, a data rank and a tensor-parallel group are the same in
        both."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.fsdp, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"),
        )

    def distributed_config(self):
        """transformers' DistributedConfig of this layout without pipeline stages (pp == 1), or of one stage's ranks
        (the sizes inside a stage)."""
        from transformers.distributed import DistributedConfig

        return DistributedConfig(
            tp_size=self.tp, ep_size=self.ep, fsdp_size=self.fsdp, dp_replicate_size=self.dp_replicate
        )


def suggest_fix(world: int, sizes: dict, text_config, seq_len: int | None = None) -> str | None:
    """The one flag that makes a refused layout (`sizes`: the flags given to `ParallelDims.for_model`) run on `world`
    ranks, in this order of preference: "add --fsdp 2" (a size left at 1, tried in the order fsdp, ep, cp, tp, pp,
    from the smallest up), "use --tp 4" (another size of one that was set, the nearest first), "drop --ep 3"; None
    when no single flag does (or a size is not a positive integer). With fsdp left out, the flag's layout leaves
    fsdp out too (the data ranks the other sizes leave)."""
    given = {n: sizes.get(n, None if n == "fsdp" else 1) for n in ("fsdp", "ep", "cp", "tp", "pp")}
    shown = {n: (1 if v in (None, -1) else v) for n, v in given.items()}
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in (*shown.values(), world)):
        return None
    here = [d for d in range(2, world + 1) if world % d == 0]  # every size divides the world
    tries = [("add", n, v) for n, s in shown.items() if s == 1 for v in here]
    tries += [
        ("use", n, v) for n, s in shown.items() if s > 1 for v in sorted(here, key=lambda v: (abs(v - s), v)) if v != s
    ]
    tries += [("drop", n, 1) for n, s in shown.items() if s > 1]
    rest = {n: v for n, v in sizes.items() if n not in given}  # dp_replicate, as given
    for verb, name, size in tries:
        try:
            ParallelDims.resolve(world, **{**rest, **given, name: size})._check(text_config, seq_len)
        except ValueError:
            continue
        return f"{verb} --{name} {shown[name] if verb == 'drop' else size}"
    return None


def data_mesh(mesh):
    """The data-parallel sub-mesh of a ("pp", "dp_replicate", "fsdp", "tp") mesh: 2-D (HSDP's replicate x shard) when
    both sizes are > 1, else the one that is (FSDP2 shards over it)."""
    replicate, shard = mesh["dp_replicate"].size(), mesh["fsdp"].size()
    if replicate > 1 and shard > 1:
        return mesh["dp_replicate", "fsdp"]
    return mesh["dp_replicate"] if replicate > 1 else mesh["fsdp"]


def data_rank(mesh) -> int:
    """This rank's index among the data ranks of a ("pp", "dp_replicate", "fsdp", "tp") mesh."""
    return mesh["dp_replicate"].get_local_rank() * mesh["fsdp"].size() + mesh["fsdp"].get_local_rank()


__all__ = ["SIZES", "ParallelDims", "data_mesh", "data_rank", "suggest_fix"]
