"""``python -m lightning_zoff.consolidate CKPT_DIR OUT_FILE``: the command `lightning_zoff.checkpoint.consolidate`
documents, under the name users type."""

from lightning_zoff.checkpoint.consolidate import consolidate, main

__all__ = ["consolidate", "main"]

if __name__ == "__main__":
    main()
