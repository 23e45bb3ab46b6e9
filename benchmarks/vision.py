"""Vision tower benchmark on CPU: kimi_hf's KimiHybridVisionModel (+ projector) against transformers'
kimi_k25 tower (Kimi_K25VisionModel + Kimi_K25MultimodalProjection) with the same weights, on
448 x 448 images (32 x 32 patches), in the same process.

    python benchmarks/vision.py                 # small config (hidden 256, 4 layers), 1 and 4 images
    python benchmarks/vision.py --hidden 1152 --layers 27 --heads 16 --intermediate 4304   # K2.5's tower

Prints median forward times, the spread of the repeats, our speed-up and the max difference of the
outputs; a WARNING line says when the spread is too large to trust the speed-up. Nothing else should
run on the machine meanwhile.
"""

from __future__ import annotations

import os
import sys


sys.modules.setdefault("fla", None)

import torch  # noqa: E402


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import argument_parser, spread_cell, spread_warning, timed, warn  # noqa: E402
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config, Kimi_K25VisionConfig  # noqa: E402
from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25MultimodalProjection, Kimi_K25VisionModel  # noqa: E402

from kimi_hf import KimiHybridVisionConfig, KimiHybridVisionModel  # noqa: E402
from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid_vision import KimiHybridMultimodalProjector  # noqa: E402


def towers(args):
    size = dict(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=args.intermediate,
    )
    torch.manual_seed(0)
    ref = Kimi_K25VisionModel(
        Kimi_K25VisionConfig(**size, rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    )
    ref_proj = Kimi_K25MultimodalProjection(
        Kimi_K25Config(
            text_config={"model_type": "deepseek_v3", "hidden_size": args.text_hidden},
            vision_config=size,
            projection_hidden_size=args.hidden,
        )
    )
    ours = KimiHybridVisionModel(KimiHybridVisionConfig(**size))
    ours_proj = KimiHybridMultimodalProjector(args.hidden, 4, args.text_hidden)
    ours.load_state_dict(ref.state_dict())
    ours_proj.load_state_dict(ref_proj.state_dict())
    for m in (ref, ref_proj, ours, ours_proj):
        m.eval()
    return (lambda pv, g: ref_proj(ref(pv, grid_thw=g).pooler_output).squeeze(1)), (
        lambda pv, g: ours_proj(ours(pv, g).pooler_output)
    )


def main(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--hidden", type=int, default=256, help="tower hidden size")
    p.add_argument("--layers", type=int, default=4, help="tower layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--intermediate", type=int, default=1024, help="MLP size")
    p.add_argument("--text-hidden", type=int, default=256, help="the projector's output size")
    p.add_argument("--images", type=int, nargs="+", default=[1, 4], help="images per forward")
    p.add_argument("--size", type=int, default=448, help="image side in pixels (a multiple of 28)")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards after a warm-up")
    args = p.parse_args(argv)
    torch.set_flush_denormal(True)
    ref, ours = towers(args)
    side = args.size // 14
    print(
        f"# vision tower on CPU: torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; hidden {args.hidden}, "
        f"{args.layers} layers, {args.heads} heads; {args.size} x {args.size} images ({side} x {side} patches); median of {args.repeats}"
    )
    print("# spread: interquartile range / median of the repeats, the worst of the row ('!': too noisy to compare)")
    print("| images | ours ms | kimi_k25 ms | spread | speed-up | max abs diff |")
    print("|---|---|---|---|---|---|")
    times = {}
    for n in args.images:
        grid = torch.tensor([[1, side, side]] * n)
        pv = torch.randn(n * side * side, 3, 14, 14, generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            diff = (ref(pv, grid) - ours(pv, grid)).abs().max().item()
            t_ref = timed(lambda: ref(pv, grid), args.repeats)
            t_ours = timed(lambda: ours(pv, grid), args.repeats)
        times.update({f"{n} images ours": t_ours, f"{n} images kimi_k25": t_ref})
        print(
            f"| {n} | {t_ours.ms:.1f} | {t_ref.ms:.1f} | {spread_cell(t_ours, t_ref)} "
            f"| {t_ref.median / t_ours.median:.2f}x | {diff:.1e} |",
            flush=True,
        )
    warn(spread_warning(times))


if __name__ == "__main__":
    main()
