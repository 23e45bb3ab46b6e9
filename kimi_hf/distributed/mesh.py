"""The device mesh of a training layout: pipeline (pp), replicated data (dp_replicate), fully sharded data (fsdp)
and tensor / expert parallel (tp, ep) sizes over the world, with the checks of `kimi_hf.plan.layout` (sizes
dividing the world, the heads, the experts; a pipeline stage without layers) made before any model is built.

    layout = TrainingLayout(pp=2, fsdp=2)
    layout.check(world_size, text_config)                 # ValueError naming the size and the flag that fixes it
    mesh = layout.build_mesh("cpu")                       # DeviceMesh ("pp", "dp_replicate", "fsdp", "tp")

What runs on which mesh (docs/parallelism.md):
- cp > 1: every cp consecutive data ranks split one batch's sequences (kimi_hf.distributed.context); the engines
  below see them as data ranks (their gradients are reduced with the others');
- pp > 1: each stage's rank group is mesh["pp"]; a stage is fully sharded over ("dp_replicate", "fsdp") (HSDP when
  both are > 1) with torch's fully_shard (kimi_hf.distributed.pipeline.shard_stage); with ep > 1 transformers'
  expert parallelism shards the stage's experts over ep of its data ranks as it loads (load_pipeline_stage); with
  tp > 1 transformers' tensor (and expert) parallelism shard the stage over its ranks, which then are all tensor-
  parallel (world = pp x tp).
- pp == 1: tensor / expert parallelism are transformers' (DistributedConfig(tp_size, ep_size, ...)), on its own
  mesh; without them the model is fully sharded over ("dp_replicate", "fsdp").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch.distributed as dist


@dataclass(frozen=True)
class TrainingLayout:
    """Sizes of the parallel dimensions (each >= 1). The data ranks (distinct batches) are the rest of the world:
    dp_replicate = world / (pp x tp x fsdp)."""

    tp: int = 1
    ep: int = 1
    pp: int = 1
    fsdp: int = 1
    cp: int = 1

    def check(self, world_size: int, text_config) -> int:
        """Raises ValueError for a layout that cannot run the model on `world_size` ranks or that this package does
        not run yet, naming the size and, where one flag makes it run, that flag (`fix`); returns dp_replicate."""
        try:
            return self._check(world_size, text_config)
        except ValueError as e:
            fix = self.fix(world_size, text_config)
            raise ValueError(f"{e}; {fix}" if fix else str(e)) from None

    def fix(self, world_size: int, text_config) -> str | None:
        """The one flag that makes this refused layout run on `world_size` ranks, in this order of preference:
        "add --fsdp 2" (a size left at 1, tried in the order fsdp, ep, cp, tp, pp, from the smallest size up), "use
        --tp 4" (another size of one that was set, the nearest first), "drop --ep 3"; None when no single flag does
        (or a size is not a positive integer)."""
        sizes = asdict(self)
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in sizes.values()):
            return None
        order = ("fsdp", "ep", "cp", "tp", "pp")
        sizes_here = [d for d in range(2, world_size + 1) if world_size % d == 0]  # every size divides the world
        tries = [("add", n, v) for n in order if sizes[n] == 1 for v in sizes_here]
        tries += [
            ("use", n, v)
            for n in order
            if sizes[n] > 1
            for v in sorted(sizes_here, key=lambda v: (abs(v - sizes[n]), v))
            if v != sizes[n]
        ]
        tries += [("drop", n, 1) for n in order if sizes[n] > 1]
        for verb, name, size in tries:
            try:
                replace(self, **{name: size})._check(world_size, text_config)
            except ValueError:
                continue
            return f"{verb} --{name} {sizes[name] if verb == 'drop' else size}"
        return None

    def _check(self, world_size: int, text_config) -> int:
        from ..plan.layout import Layout, check_layout

        for name, size in asdict(self).items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"--{name} must be a positive integer, got {size!r}")
        if self.tp > 1 and self.fsdp > 1:
            raise ValueError(
                f"--tp {self.tp} with --fsdp {self.fsdp}: transformers 5.24's loader cannot cut tensors with a size-1 "
                "first dim (K3's Attention Residual queries, stored [1, d]) over a 2-D mesh; use --tp with --ep, or "
                "--fsdp (with --ep / --pp)"
            )
        layout = Layout(tp=self.tp, ep=self.ep, pp=self.pp, fsdp=self.fsdp)
        try:
            replicate = check_layout(layout, world_size, text_config)
        except ValueError as e:  # the planner says --gpus; a launched job has a world size
            raise ValueError(str(e).replace("--gpus", "the world size")) from None
        if self.pp > 1 and self.tp > 1 and world_size != self.pp * self.tp:
            raise ValueError(
                f"--pp {self.pp} with --tp {self.tp} on {world_size} ranks: tensor parallelism inside a pipeline stage "
                f"runs without data parallelism in this version (the world size must be pp x tp = {self.pp * self.tp})"
            )
        data = self.data_ranks(world_size)
        if data % self.cp:
            raise ValueError(
                f"--cp {self.cp} does not divide the {data} data ranks (world size {world_size} / (pp x tp)): each "
                "batch is split over --cp data ranks"
            )
        return replicate

    def data_ranks(self, world_size: int) -> int:
        """The data ranks of the parallelism engines (FSDP2 / transformers average gradients over them):
        dp_replicate x fsdp = world / (pp x tp)."""
        return world_size // (self.pp * self.tp)

    def batch_ranks(self, world_size: int) -> int:
        """How many ranks see distinct batches: the data ranks over cp (a context-parallel group splits one)."""
        return self.data_ranks(world_size) // self.cp

    def build_mesh(self, device_type: str, world_size: int | None = None):
        """DeviceMesh ("pp", "dp_replicate", "fsdp", "tp") over the world (pp > 1, or pp == tp == ep == 1): the
        dimensions of transformers' dense mesh, in its order, so that the ranks of a stage, a data rank and a
        tensor-parallel group are the same in both."""
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size() if world_size is None else world_size
        replicate = world // (self.pp * self.fsdp * self.tp)
        return init_device_mesh(
            device_type,
            (self.pp, replicate, self.fsdp, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"),
        )


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


__all__ = ["TrainingLayout", "data_mesh", "data_rank"]
