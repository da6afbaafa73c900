"""Checkpoints, for either front door and for none: what a checkpoint holds by the module's own names (`state`),
the files on disk and their checks (`files`, one file per rank: `rank_files`; the older layout: `dcp_files`), a
rank's saving and loading (`checkpoints`), whole weights as users have them (`pretrained`), the set-up model's own
`load_state_dict` of whole tensors (`whole_loads`) and one fp32 file from a sharded checkpoint (`consolidate`)."""

from lightning_zoff.checkpoint.files import CheckpointError
from lightning_zoff.checkpoint.state import full_optimizer_state, full_state_dict

__all__ = ["CheckpointError", "full_optimizer_state", "full_state_dict"]
