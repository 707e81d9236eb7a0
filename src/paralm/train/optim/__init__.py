"""Optimizers and the learning-rate schedule: AdamW and SGD with weight-decay groups (`build`), Muon on the
blocks' matrices (`muon`), warm-up and cosine decay (`schedule`)."""
