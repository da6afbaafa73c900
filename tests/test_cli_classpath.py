"""ZoffStrategy as a LightningCLI class_path, with its options from the command line."""

from lightning.pytorch.cli import LightningCLI

from helpers.tiny_module import TinyModule
from lightning_zoff import ZoffStrategy


def test_strategy_from_class_path():
    cli = LightningCLI(TinyModule, run=False, args=[
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.logger=false",
        "--trainer.strategy.class_path=lightning_zoff.ZoffStrategy",
        "--trainer.strategy.init_args.start_method=fork",
        "--trainer.strategy.init_args.grad_accum_on=accelerator",
        "--trainer.strategy.init_args.cpu_threads=1",
    ])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ZoffStrategy)
    config = strategy.config
    assert (config.start_method, config.grad_accum_on, config.cpu_threads) == ("fork", "accelerator", 1)


def test_registered_name_from_the_cli():
    cli = LightningCLI(TinyModule, run=False, args=["--trainer.accelerator=cpu", "--trainer.strategy=zoff_no_offload",
                                                    "--trainer.logger=false"])
    assert isinstance(cli.trainer.strategy, ZoffStrategy)
    assert not cli.trainer.strategy.config.offload
