"""What the tests share. `tiny` (the tiny transformer, its data and its AdamW), `reference` (its training on one
process in fp32) and `compare` (`rel_err`, how two runs' numbers are compared) are plain torch, for the tests that
run without Lightning; the rest drive a Trainer (`trainer.fit`) or Fabric (`fabric_loop`)."""
