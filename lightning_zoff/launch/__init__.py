"""How a rank starts and where it stands: its process group (`ranks`, `group`), its CPU cores (`cpus`), its C
allocator (`malloc`), its messages once per node (`node_log`) and its errors once per node (`rank_errors`). Shared by
both front doors; only `ranks` imports Lightning (its process-group and seed utilities)."""
