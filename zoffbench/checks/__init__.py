"""The checks that pass or fail on a machine, each behind its entry point scripts/checks/check_<name>.py, and what
tests/gpu asserts on (`compare`): overlap.py (the overlapped engine against the synchronous one), placement.py (state on
the GPU against the host), reference.py (zoff against DDP), scaling.py (one rank against several)."""
