"""Checkpoints: sharded, atomic and portable saves (`store`), how they are read safely (`reader`), their
manifest (`integrity`), writing in the background (`saver`), the loop's view of them (`loop`), the pruning
masks beside the state (`masked`), the resumed global batch (`resume_batch`), and a new run's weights from
another model (`init_from`)."""
