"""The application of lightning_zoff: the machinery of the main job (scripts/train.py, scripts/train_fabric.py) and of
the CLI (`python -m lightning_zoff.cli`), apart from the strategy they use and from the example models they train
(`lightning_zoff.examples`).

- `progress`: the progress bar, counting the batches this run trains;
- `quiet`: what the job leaves out of its output;
- `report`: what a run shows at its end (loss curve, step breakdown, the sample as text);
- `resume`: `ckpt_path=`, checked before any rank starts;
- `resumable`: a DataLoader that a run resumed mid-epoch continues where its checkpoint left it.
"""
