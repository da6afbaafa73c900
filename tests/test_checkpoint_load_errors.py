"""What a load says when torch.load fails on a checkpoint's meta.pt or full file: the globals torch's weights-only
unpickler refuses and the remedy (the file is whole), "truncated" only where the file ends inside its zip archive.
One process, no Trainer: `check_loadable` is what the doors run before any rank starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lightning_zoff.checkpoint.files import FORMAT_VERSION, META_FILE, CheckpointError, check_loadable, read


class Vocabulary:
    """A class of the user's, kept in the hyperparameters: torch's weights-only unpickler refuses it."""

    def __init__(self, size: int) -> None:
        self.size = size


def write_meta(directory: Path, hyper_parameters: dict) -> Path:
    directory.mkdir()
    info = {"format_version": FORMAT_VERSION, "layout": "sharded", "world_size": 1, "tensors": {}, "files": {}}
    torch.save({"zoff": info, "hyper_parameters": hyper_parameters, "global_step": 6}, directory / META_FILE)
    return directory / META_FILE


def test_a_refused_global_in_meta_is_named_with_the_remedy(tmp_path):
    ckpt = tmp_path / "last.ckpt"
    meta = write_meta(ckpt, {"vocabulary": Vocabulary(50)})
    name = f"{Vocabulary.__module__}.Vocabulary"
    with pytest.raises(CheckpointError) as err:
        check_loadable(ckpt)
    message = str(err.value)
    assert message.startswith(f"{meta}: torch's weights-only load refuses the global {name}:")
    assert f"torch.serialization.add_safe_globals([{name}])" in message
    assert "weights_only=False" in message
    assert "truncated" not in message
    assert "not a torch checkpoint" not in message
    # each remedy it names loads the file
    check_loadable(ckpt, weights_only=False)
    with torch.serialization.safe_globals([Vocabulary]):
        assert read(ckpt)["hyper_parameters"]["vocabulary"].size == 50


def test_every_refused_global_is_named_at_once(tmp_path):
    omegaconf = pytest.importorskip("omegaconf")
    config = omegaconf.OmegaConf.create({"model": {"d": 64}, "layers": [1, 2]})
    write_meta(tmp_path / "last.ckpt", {"cfg": config})
    with pytest.raises(CheckpointError) as err:
        check_loadable(tmp_path / "last.ckpt")
    allowed = re.search(r"add_safe_globals\(\[(.*?)\]\)", str(err.value))
    assert allowed is not None
    names = allowed.group(1).split(", ")
    assert names[0] == "omegaconf.dictconfig.DictConfig"  # the one torch's own message names
    assert {"omegaconf.listconfig.ListConfig", "omegaconf.base.ContainerMetadata"} <= set(names)


def test_a_full_file_with_a_refused_global_names_it(tmp_path):
    path = tmp_path / "model.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "hyper_parameters": {"vocabulary": Vocabulary(3)}}, path)
    with pytest.raises(CheckpointError, match=r"model\.ckpt: torch's weights-only load refuses the global \S+Vocab"):
        read(path)


@pytest.mark.parametrize("layout", ["sharded", "full"])
def test_a_truncated_file_says_truncated(tmp_path, layout):
    if layout == "sharded":
        file = write_meta(tmp_path / "last.ckpt", {"lr": 0.1})
        path = file.parent
    else:
        path = file = tmp_path / "model.ckpt"
        torch.save({"state_dict": {"w": torch.zeros(64)}}, file)
    size = file.stat().st_size
    file.write_bytes(file.read_bytes()[: size // 2])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(file))}: truncated: its {size // 2} bytes end inside"):
        check_loadable(path)


def test_a_file_that_is_no_checkpoint_is_not_called_truncated(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=r"notes\.txt: cannot be read: not a torch checkpoint") as err:
        check_loadable(notes)
    assert "truncated" not in str(err.value)
