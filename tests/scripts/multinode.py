"""One node of a simulated 2-node x 1-process run, configured as on a cluster by MASTER_ADDR, MASTER_PORT and
NODE_RANK in the environment (Lightning's default cluster environment reads them).

    python multinode.py OUT [CKPT]    # trains 12 steps with a checkpoint every 6, or resumes from CKPT
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.resume_run import resume_fit

out = Path(sys.argv[1])
ckpt = sys.argv[2] if len(sys.argv) > 2 else None
callbacks = [] if ckpt else [ModelCheckpoint(dirpath=out / "ck", save_top_k=-1, every_n_train_steps=6)]
resume_fit(out / "run", devices=1, num_nodes=2, ckpt_path=ckpt, callbacks=callbacks, start_method="subprocess")
