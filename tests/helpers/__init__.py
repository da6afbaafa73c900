"""What the tests share. `tiny` (the tiny transformer, its data and its AdamW) and `reference` (its training on one
process in fp32) are plain torch, for the tests that run without Lightning; the rest drive a Trainer (`trainer.fit`)
or Fabric (`fabric_loop`)."""
