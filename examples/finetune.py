"""Fine-tune pretrained weights on one workstation: one process, optimizer state offloaded.

    python examples/train.py trainer.devices=1      # pretrain: writes outputs/<date>/<time>/final.ckpt
    python examples/finetune.py                     # newest final.ckpt, offload=nvme under $TMPDIR
    python examples/finetune.py offload=cpu finetune.pretrained=gpt.safetensors
    python examples/finetune.py offload.path=/mnt/nvme trainer.max_steps=500
    python examples/finetune.py model=hf model.path=/models/qwen2-0.5b data=text data.path=notes/ offload=cpu
    python examples/finetune.py model=hf model.path=DIR data=chat data.path=chats.jsonl
    python examples/finetune.py resume=last         # continue the newest fine-tune run (outputs/finetune/)

Preset: conf/finetune.yaml (the docs corpus, activation checkpointing, bf16-mixed). Writes
summary.json (as examples/train.py, plus the pretrained file), last.ckpt and final.ckpt to the
run directory, outputs/finetune/<date>/<time>. A Hugging Face model directory (``model=hf
model.path=DIR``) brings its own weights and tokenizer (``data=text``: local .txt / .jsonl files).
A missing or mismatched pretrained file, model directory, tokenizer or text ends the app with one
``error:`` line and exit code 2, before any work (so does a bad command line, see
:mod:`lightning_3d.app.cli`).
"""

from omegaconf import DictConfig

from lightning_3d.app.cli import hydra_app
from lightning_3d.app.config import register_configs
from lightning_3d.app.finetune import main as finetune_main


def main(cfg: DictConfig) -> int:
    return finetune_main(cfg, script=__file__)


if __name__ == "__main__":
    register_configs()
    hydra_app(main, config_path="../conf", config_name="finetune")
