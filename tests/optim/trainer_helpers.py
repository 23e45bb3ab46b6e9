"""The data and TrainingArguments the Trainer tests share (test_trainer, test_expert_bias, test_training_k3)."""

import torch
from datasets import Dataset
from transformers import TrainingArguments


def dataset(n=16, T=24):
    x = torch.randint(3, 97, (n, T), generator=torch.Generator().manual_seed(0))
    return Dataset.from_dict({"input_ids": x.tolist(), "labels": x.tolist()})


def args(tmp_path, **kw):
    """TrainingArguments of a short CPU run writing nothing but tmp_path; kw override or add to them."""
    defaults = dict(
        max_steps=6,
        per_device_train_batch_size=4,
        logging_steps=2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    return TrainingArguments(output_dir=str(tmp_path), **{**defaults, **kw})
