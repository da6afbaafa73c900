"""zoff on this machine's accelerator against an fp32 CPU reference (DDP + torch.optim.AdamW), same data and init.

    python scripts/checks/check_reference.py --steps 60 --out ref_check.json
    python scripts/checks/check_reference.py --option accelerator_state="'none'" --option accelerator_update_share=1.0

The check itself: zoffbench/checks/reference.py.
"""

from zoffbench.checks.reference import main

if __name__ == "__main__":
    main()
