"""Fine-tune pretrained weights on one workstation: the package's fine-tune app
(:mod:`lightning_3d.app.finetune`, installed as ``lightning3d-finetune``), run from a checkout.

    python examples/train.py trainer.devices=1      # pretrain: writes outputs/<date>/<time>/final.ckpt
    python examples/finetune.py                     # newest final.ckpt, offload=nvme under $TMPDIR
    python examples/finetune.py offload=cpu finetune.pretrained=gpt.safetensors
    python examples/finetune.py model=hf model.path=DIR data=chat data.path=chats.jsonl
    python examples/finetune.py resume=last         # continue the newest fine-tune run (outputs/finetune/)

Preset: lightning_3d/app/conf/finetune.yaml (the docs corpus, activation checkpointing, bf16-mixed).
"""

from lightning_3d.app.finetune import main

if __name__ == "__main__":
    main()
