"""How a node's cores are split among its ranks (what each rank logs as its thread layout)."""

from lightning_zoff.launch.cpus import core_share, plan_layout


def test_each_rank_gets_its_own_equal_slice():
    cores = list(range(32))
    shares = [core_share(cores, rank, 2) for rank in (0, 1)]
    assert shares == [tuple(range(16)), tuple(range(16, 32))]  # disjoint: no oversubscription
    assert [len(core_share(cores, r, 3)) for r in range(3)] == [10, 10, 10]
    assert core_share([0, 1], 3, 4) == (1,)  # more ranks than cores: share round-robin, at least one each


def test_the_training_thread_keeps_a_core_on_gpu_machines():
    layout = plan_layout(range(16), 0, 1, None)
    assert (layout.kernel_threads, layout.torch_threads) == (16, 1)
    assert layout.describe() == "cores 0-15 (16), 16 optimizer threads, 1 torch threads"
    assert plan_layout(range(16), 1, 2, None).kernel_threads == 8
    layout = plan_layout(range(16), 0, 1, 4)  # asked for: torch keeps the rest
    assert (layout.kernel_threads, layout.torch_threads) == (4, 12)
