"""Generated images for vision tasks that need no download: scenes of coloured shapes and
questions about them (counting, as in the seeds' vision-only tasks that improved reasoning)."""

from __future__ import annotations

import random

from PIL import Image, ImageDraw


QUESTION = "How many circles are there?"


def render_scene(rng: random.Random, size: int = 84, circles: int = 1, squares: int = 0) -> Image.Image:
    """A size x size RGB scene with `circles` filled circles and `squares` filled squares of random
    colours and sizes on a light background, placed without overlap."""
    bg = tuple(rng.randint(200, 255) for _ in range(3))
    image = Image.new("RGB", (size, size), bg)
    draw = ImageDraw.Draw(image)
    boxes = []
    for kind in ["circle"] * circles + ["square"] * squares:
        for _ in range(200):  # rejection sampling of a free spot
            r = rng.randint(max(3, size // 14), max(4, size // 8))
            x, y = rng.randint(r + 1, size - r - 2), rng.randint(r + 1, size - r - 2)
            box = (x - r, y - r, x + r, y + r)
            if all(box[2] + 2 < b[0] or b[2] + 2 < box[0] or box[3] + 2 < b[1] or b[3] + 2 < box[1] for b in boxes):
                break
        else:
            raise ValueError(f"no room for {circles + squares} shapes in a {size} x {size} scene")
        boxes.append(box)
        colour = tuple(rng.randint(0, 160) for _ in range(3))
        (draw.ellipse if kind == "circle" else draw.rectangle)(box, fill=colour)
    return image


def counting_examples(n: int, seed: int, size: int = 84, max_count: int = 4, max_squares: int = 2) -> list[dict]:
    """n chat examples {"messages", "images", "answer"}: a scene with 1..max_count circles and
    0..max_squares distracting squares, the question QUESTION, the count as the answer."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        count, squares = rng.randint(1, max_count), rng.randint(0, max_squares)
        image = render_scene(rng, size, count, squares)
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": str(count)},
        ]
        out.append({"messages": messages, "images": [image], "answer": str(count)})
    return out


def ask(
    model, processor, images, question: str = QUESTION, max_new_tokens: int = 2, chat_template_kwargs=None
) -> list[str]:
    """Greedy answers of a multimodal model to `question` about each image (one batch)."""
    from .chat import generate_replies

    question_about_image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return generate_replies(
        model, processor, [question_about_image] * len(images), images, max_new_tokens, chat_template_kwargs
    )


def counting_accuracy(
    model, processor, examples: list[dict], batch: int = 32, max_new_tokens: int = 2, chat_template_kwargs=None
) -> tuple[float, dict]:
    """(accuracy, {count: accuracy}) of greedy answers on counting examples (held-out scenes)."""
    was_training = model.training
    model.eval()
    right, per_count = 0, {}
    for i in range(0, len(examples), batch):
        chunk = examples[i : i + batch]
        answers = ask(
            model,
            processor,
            [ex["images"][0] for ex in chunk],
            max_new_tokens=max_new_tokens,
            chat_template_kwargs=chat_template_kwargs,
        )
        for ex, ans in zip(chunk, answers):
            ok = ans == ex["answer"]
            right += ok
            hit = per_count.setdefault(ex["answer"], [0, 0])
            hit[0], hit[1] = hit[0] + ok, hit[1] + 1
    model.train(was_training)
    return right / len(examples), {k: v[0] / v[1] for k, v in sorted(per_count.items())}


__all__ = ["render_scene", "counting_examples", "counting_accuracy", "ask", "QUESTION"]
